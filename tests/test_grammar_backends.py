"""Grammar backends against the GrammarMatcher contract, the byte guard, the sampler's
mask, and the core's compiler (cache, auto, errors). No model runs here."""

from __future__ import annotations

import threading

import pytest
import torch

from modserve.core.config import PluginChoice
from modserve.engine.grammar import GrammarCompiler
from modserve.core.hookspecs import hookimpl
from modserve.core.contracts.grammar_backend import GrammarBackend, GrammarMatcher, GrammarVocab
from modserve.core.registry import Registry
from modserve.core.structured_outputs import GrammarSpec, StructuredOutputs
from modserve.engine.token_bytes import token_bytes
from modserve.samplers.default import apply_token_bitmask

EOS = 2
BACKENDS = ["xgrammar", "outlines"]


@pytest.fixture(scope="module")
def hf_tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def vocab(hf_tokenizer) -> GrammarVocab:
    # 4 ids past the tokenizer's, as models pad their embedding tables.
    return GrammarVocab(tuple(token_bytes(hf_tokenizer, len(hf_tokenizer) + 4)), (EOS,), "test")


@pytest.fixture(scope="module")
def backends(vocab) -> dict[str, GrammarBackend]:
    reg = Registry()
    reg.load_entrypoints({"modserve"})
    return {name: reg.create("grammar_backend", PluginChoice(name=name), vocab) for name in BACKENDS}


def allowed(matcher: GrammarMatcher, vocab_size: int) -> set[int]:
    bitmask = torch.full((2, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 1)
    assert (bitmask[0] == -1).all(), "fill_bitmask wrote outside its row"
    bits = (bitmask[1].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist())


def feed(matcher: GrammarMatcher, hf_tokenizer, text: str) -> bool:
    return all(matcher.accept_token(t) for t in hf_tokenizer.encode(text, add_special_tokens=False))


# -- specs -------------------------------------------------------------------------------
def test_structured_outputs_takes_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one.*got 2: json, regex"):
        StructuredOutputs(json={"type": "string"}, regex="a+")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputs(json="{nope")
    with pytest.raises(ValueError, match="choice must be"):
        StructuredOutputs(choice=[])
    as_dict = StructuredOutputs(json={"type": "object", "b": 1, "a": 2}).spec()
    as_text = StructuredOutputs(json='{"type": "object", "b": 1, "a": 2}').spec()
    assert as_dict == as_text and as_dict.value == '{"type":"object","b":1,"a":2}'  # key order kept


def test_token_bytes_spell_the_text(hf_tokenizer, vocab):
    text = 'héllo wörld 日本語 😀 {"a": [1, 2.5]}\n\tend'
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(vocab.token_bytes[i] for i in ids) == text.encode()
    assert vocab.token_bytes[EOS] is None and vocab.token_bytes[-1] is None


# -- the sampler's mask ------------------------------------------------------------------------
def test_apply_token_bitmask_keeps_exactly_the_set_bits():
    V = 70
    logits = torch.zeros(2, V)
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0] = -1  # row 0 unconstrained
    for t in (0, 31, 32, 63, 69):  # bit 31 is the int32 sign bit
        bitmask[1, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 31, 32, 63, 69]


# -- the matcher contract, for every backend -----------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_matcher_contract(backends, vocab, hf_tokenizer, backend):
    b = backends[backend]
    m = b.matcher(b.compile(GrammarSpec("regex", r"ab[0-9]{2}")), max_rollback=8)
    V = vocab.vocab_size
    start = allowed(m, V)
    assert EOS not in start and start, "EOS only where the grammar may end"
    assert all(vocab.token_bytes[t].startswith(b"a") for t in start)
    bad = next(t for t in range(3, V) if t not in start and vocab.token_bytes[t])
    assert not m.accept_token(bad) and allowed(m, V) == start, "a refused token changes nothing"
    assert feed(m, hf_tokenizer, "ab1")
    assert EOS not in allowed(m, V)
    assert feed(m, hf_tokenizer, "2") and allowed(m, V) == {EOS}
    assert m.accept_token(EOS) and m.is_terminated()
    m.rollback(2)  # the EOS and the "2"
    assert not m.is_terminated() and EOS not in allowed(m, V)
    assert feed(m, hf_tokenizer, "7") and m.accept_token(EOS)
    m.reset()
    assert not m.is_terminated() and allowed(m, V) == start


@pytest.mark.parametrize("backend", BACKENDS)
def test_choice_and_json(backends, hf_tokenizer, backend):
    b = backends[backend]
    choice = b.compile(GrammarSpec("choice", ("yes", 'a "quoted" one', "x|y")))
    for text in ("yes", 'a "quoted" one', "x|y"):
        m = b.matcher(choice, 8)
        assert feed(m, hf_tokenizer, text) and m.accept_token(EOS), text
    m = b.matcher(choice, 8)
    assert feed(m, hf_tokenizer, "x") and not m.accept_token(EOS)  # a prefix of "x|y" only
    schema = StructuredOutputs(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                     "required": ["n"]}).spec()
    m = b.matcher(b.compile(schema), 8)
    assert feed(m, hf_tokenizer, '{"n": 12}') and m.accept_token(EOS)


def test_outlines_refuses_grammars_and_xgrammar_reads_lark(backends):
    assert "grammar" not in backends["outlines"].kinds
    lark = 'start: "a" NUMBER\n%import common.NUMBER\n'
    assert backends["xgrammar"].compile(GrammarSpec("grammar", lark)) is not None


# -- the byte guard ------------------------------------------------------------------------------
def test_xgrammar_never_allows_a_lone_surrogate_or_json_control_bytes():
    """A byte vocabulary where ED A0 80 (U+D800 as UTF-8) is spellable, as one token
    and across tokens: xgrammar's string rule accepts it; the guard must not."""
    from modserve.plugins.grammars.xgrammar_backend import XGrammarBackend

    token_b = [None, None, None] + [bytes([i]) for i in range(256)] + [b"\xed\xa0\x80", b"a\n"]
    vocab = GrammarVocab(tuple(token_b), (EOS,), "bytes")
    be = XGrammarBackend(vocab)
    tid = {b: i for i, b in enumerate(token_b) if b}
    for spec in (StructuredOutputs(json={"type": "string"}).spec(), GrammarSpec("regex", r"x(.|\n)*")):
        m = be.matcher(be.compile(spec), 8)
        first = '"' if spec.kind == "json" else "x"
        assert m.accept_token(tid[first.encode()])
        ok = allowed(m, vocab.vocab_size)
        assert tid[b"\xed\xa0\x80"] not in ok and tid[b"\xed"] in ok
        assert (tid[b"a\n"] in ok) == (spec.kind != "json")  # raw newline: fine in text, never in JSON
        assert m.accept_token(tid[b"\xed"])
        after = allowed(m, vocab.vocab_size)
        assert tid[b"\x80"] in after and tid[b"\xa0"] not in after  # U+D000.. yes, U+D800.. no


# -- the core's compiler ----------------------------------------------------------------------------
class _Slow(GrammarBackend):
    """Compiles "regex" only, waiting for ``release``; counts compiles."""

    kinds = frozenset({"regex"})
    release = threading.Event()
    compiles = 0

    def compile(self, spec):
        type(self).compiles += 1
        if not self.release.wait(30):
            raise RuntimeError("never released")
        if spec.value == "bad":
            raise ValueError("slow says no")
        return spec.value

    def matcher(self, compiled, max_rollback):
        raise NotImplementedError


class _SlowPlugin:
    @hookimpl
    def register_grammar_backends(self, register):
        register("slow", lambda: _Slow)


@pytest.fixture
def compiler(llama_dir):
    """GrammarCompiler(registry, backend name, **kw) on the test tokenizer; closed after the test."""
    made = []

    def make(name: str, registry: Registry | None = None, **kw) -> GrammarCompiler:
        if registry is None:
            registry = Registry()
            registry.load_entrypoints({"modserve"})
        made.append(GrammarCompiler(registry, PluginChoice(name=name), llama_dir, 4100, [EOS], cache_size=2, **kw))
        return made[-1]

    yield make
    for gc in made:
        gc.close()


def test_cache_compiles_a_spec_once_and_is_lru(compiler):
    gc = compiler("xgrammar")
    specs = [GrammarSpec("regex", r) for r in ("a+", "b+", "c+")]
    first = gc.submit(specs[0])
    assert gc.submit(specs[0]) is first and first.result(60).backend_name == "xgrammar"
    gc.compile(specs[1])
    gc.compile(specs[2])  # evicts "a+" (cache_size=2)
    assert gc.submit(specs[0]) is not first
    assert gc.stats()["grammar_cache_hits"] == 1


def test_auto_falls_through_and_says_why_each_backend_refused(llama_dir, compiler):
    gc = compiler("auto")
    assert gc.order("json")[:2] == ["xgrammar", "outlines"] and gc.order("regex")[:2] == ["outlines", "xgrammar"]
    assert gc.compile(GrammarSpec("grammar", 'root ::= "a"'), timeout=60).backend_name == "xgrammar"
    with pytest.raises(ValueError) as e:
        gc.compile(GrammarSpec("regex", "a(?=b)"), timeout=60)
    msg = str(e.value)
    assert "no grammar backend accepted" in msg and "xgrammar: " in msg and "Lookahead" in msg
    assert "outlines: " in msg
    single = compiler("outlines")
    with pytest.raises(ValueError, match="outlines: does not support grammar"):
        single.compile(GrammarSpec("grammar", 'root ::= "a"'), timeout=60)
    with pytest.raises(ValueError, match="takes no options"):
        GrammarCompiler(Registry(), PluginChoice(name="auto", options={"x": 1}), llama_dir, 10, [EOS])


def test_auto_order_follows_the_priorities_backends_declare(compiler):
    import types

    registry = Registry()
    registry.load_entrypoints({"modserve"})
    target = "modserve.plugins.grammars.outlines_backend:OutlinesBackend"

    def register_grammar_backends(register):
        register("eager-json", target, priority={"json": 30})  # before the built-ins for JSON only
        register("quiet", target)  # declares nothing: after every built-in, for every kind

    plugin = types.SimpleNamespace(register_grammar_backends=hookimpl(register_grammar_backends))
    registry.add_plugin(plugin, "third-party-grammars")
    gc = compiler("auto", registry)
    assert gc.order("json") == ["eager-json", "xgrammar", "outlines", "quiet"]
    assert gc.order("regex") == ["outlines", "xgrammar", "eager-json", "quiet"]


def test_compiles_run_off_the_calling_thread(compiler):
    reg = Registry()
    with reg.plugin(_SlowPlugin(), "slow"):
        gc = compiler("slow", reg, isolation="thread")  # the backend waits on this process's Event
        _Slow.release.clear()
        future = gc.submit(GrammarSpec("regex", "x"))
        assert not future.done()  # submit returned while the compile waits
        bad = gc.submit(GrammarSpec("regex", "bad"))
        _Slow.release.set()
        assert future.result(10).compiled == "x"
        with pytest.raises(ValueError, match="regex constraint refused: slow: slow says no"):
            bad.result(10)
        assert gc.submit(GrammarSpec("regex", "bad")).exception(10)  # refused specs aren't cached
        assert _Slow.compiles == 3


# -- every JSON-schema keyword is enforced or refused ------------------------------------------------
# (keyword, schema, an instance that violates it). A backend must refuse the schema or
# reject the instance; accepting it would let a "stop" output fail validation.
PROBES = [
    ("minimum", {"type": "integer", "minimum": 0, "maximum": 99}, "500"),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 5}, "5"),
    ("minimum 0", {"type": "integer", "minimum": 0}, "-3"),
    ("multipleOf", {"type": "integer", "multipleOf": 3}, "4"),
    ("minLength", {"type": "string", "minLength": 3}, '"a"'),
    ("maxLength", {"type": "string", "maxLength": 2}, '"abc"'),
    ("pattern", {"type": "string", "pattern": "^a+$"}, '"b"'),
    ("format", {"type": "string", "format": "date"}, '"x"'),
    ("format regex", {"type": "string", "format": "regex"}, '"("'),
    ("minItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1]"),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ("contains", {"type": "array", "contains": {"const": 5}}, "[1]"),
    ("minProperties", {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}, "{}"),
    ("maxProperties", {"type": "object", "maxProperties": 1}, '{"a": 1, "b": 2}'),
    ("required", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}"),
    ("additionalProperties", {"type": "object", "additionalProperties": {"type": "integer"}}, '{"b": "x"}'),
    ("patternProperties", {"type": "object", "patternProperties": {"^a": {"type": "integer"}}}, '{"ab": "x"}'),
    ("propertyNames", {"type": "object", "propertyNames": {"maxLength": 2}}, '{"abc": 1}'),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ("not", {"not": {"type": "integer"}}, "1"),
    ("if", {"if": {"type": "integer"}, "then": {"minimum": 5}}, "1"),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 5}]}, "1"),
    ("oneOf overlapping", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    ("oneOf disjoint", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, "1.5"),
    ("enum", {"enum": [1, 2]}, "3"),
    ("pattern with maxLength", {"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaaa"'),
    ("$ref to an anchor", {"$defs": {"a": {"$id": "#foo", "type": "integer"}}, "$ref": "#foo"}, '"s"'),
    ("any-value property", {"type": "object", "properties": {"a": {}}}, "{1}"),
    ("any-value additionalProperties", {"type": "object", "additionalProperties": {}}, "{ 1}"),
    ("pattern digits", {"type": "string", "pattern": "^\\d+$"}, '"\u0668"'),  # ARABIC-INDIC DIGIT EIGHT
    ("$ref", {"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a"}, '"x"'),
]


@pytest.fixture(scope="module")
def byte_backends() -> dict[str, GrammarBackend]:
    token_b = [None, None, None] + [bytes([i]) for i in range(256)]
    vocab = GrammarVocab(tuple(token_b), (EOS,), "bytes")
    reg = Registry()
    reg.load_entrypoints({"modserve"})
    return {name: reg.create("grammar_backend", PluginChoice(name=name), vocab) for name in BACKENDS}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("keyword, schema, invalid", PROBES, ids=[p[0] for p in PROBES])
def test_schema_keywords_are_enforced_or_refused(byte_backends, backend, keyword, schema, invalid):
    b = byte_backends[backend]
    try:
        compiled = b.compile(StructuredOutputs(json=schema).spec())
    except ValueError:
        return  # refused, saying why: fine
    m = b.matcher(compiled, 8)
    accepted = all(m.accept_token(3 + byte) for byte in invalid.encode()) and m.accept_token(EOS)
    assert not accepted, f"{backend} accepts {invalid} although the schema forbids it ({keyword})"


SIBLING_PROBES = [
    ("anyOf beside type", {"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "1"),
    ("anyOf beside properties", {"type": "object", "properties": {"a": {"type": "integer"}},
                                 "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, '{"a": "x"}'),
    ("$ref beside minimum", {"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "minimum": 5}, "1"),
    ("enum beside type", {"type": "string", "enum": ["a", 1]}, "1"),
    ("object keywords beside type array", {"type": "array", "items": {"type": "number"}, "properties": {},
                                           "additionalProperties": False}, "{}"),
    ("allOf of objects", {"type": "object", "properties": {"v": {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}}, "required": ["v"]},
     '{"v": {"a": 1}{"b": 2}}'),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("keyword, schema, invalid", SIBLING_PROBES, ids=[p[0] for p in SIBLING_PROBES])
def test_keywords_beside_a_combinator_are_enforced_or_refused(byte_backends, backend, keyword, schema, invalid):
    test_schema_keywords_are_enforced_or_refused(byte_backends, backend, keyword, schema, invalid)


def test_redundant_siblings_are_fine(byte_backends):
    ok = [{"type": "string", "enum": ["a", "b"]},
          {"type": "object", "anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                                        "required": ["a"]}, {"type": "object"}]},
          {"$schema": "http://json-schema.org/draft-07/schema#", "$defs": {"x": {"type": "integer"}},
           "$ref": "#/$defs/x", "minimum": 5}]  # draft 7: validators ignore $ref's siblings too
    for schema in ok:
        byte_backends["xgrammar"].compile(StructuredOutputs(json=schema).spec())


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_dot_and_classes_read_as_in_ecmascript(byte_backends, backend):
    b = byte_backends[backend]  # xgrammar's own "." takes a newline, outlines' \d any Unicode digit
    for regex, text, ok in (("x.y", "x-y", True), ("x.y", "x\ny", False), (r"\d\w", "1a", True),
                            (r"\d", "\u0668", False), (r"[\w]", "\u00e9", False)):
        m = b.matcher(b.compile(GrammarSpec("regex", regex)), 8)
        assert (all(m.accept_token(3 + c) for c in text.encode()) and m.accept_token(EOS)) == ok


def test_gbnf_empty_alternative():
    from modserve.plugins.grammars.dialect import fill_empty_alternatives

    assert fill_empty_alternatives('ws ::= | " " # a | b\nx ::= ("a" | ) "|" [|(]') == \
        'ws ::= "" | " " # a | b\nx ::= ("a" | "" ) "|" [|(]'


@pytest.mark.parametrize("regex, expected", [
    ("a.b", "a[^\\n]b"),
    ("[.]\\.", "[.]\\."),  # in a class and escaped: literal dots stay
    ("[].]x.", "[].]x[^\\n]"),  # a leading "]" is a literal, so the class ends at the second
    ("[^]a].", "[^]a][^\\n]"),
])
def test_dot_excludes_newline(regex, expected):
    from modserve.plugins.grammars.dialect import dot_excludes_newline

    assert dot_excludes_newline(regex) == expected


@pytest.mark.parametrize("regex, expected", [
    ("\\d+-\\w", "[0-9]+-[0-9A-Za-z_]"),
    ("[\\d.]\\D", "[0-9.]\\D"),  # inside a class the ranges join it; other escapes stay
    ("[]\\d]\\d", "[]0-9][0-9]"),  # a leading "]" is a literal: the class holds "]" and 0-9
    ("a\\", "a\\"),  # a trailing backslash is left for the regex engine to refuse
])
def test_ascii_classes(regex, expected):
    from modserve.plugins.grammars.dialect import ascii_classes

    assert ascii_classes(regex) == expected
