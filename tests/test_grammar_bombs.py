"""Grammar bombs: constraints that expand to huge automata, nest deep, or cannot be met.

Each is refused before it compiles by a bound that its 400 names (the server's
``grammar_max_*`` keys, :mod:`modserve.server.grammar_bounds`), or compiles within
COMPILE_S, or is refused by a backend saying why; never a 5xx, never a stalled
server. Every real schema, regex and grammar of the shared corpora passes the bounds.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from modserve.core.config import EngineConfig, PluginChoice
from modserve.engine.grammar import GrammarCompiler
from modserve.core.registry import Registry
from modserve.core.structured_outputs import GrammarSpec, StructuredOutputs
from modserve.plugins.grammars.expansion import grammar_shape, json_depth, regex_shape
from modserve.server.grammar_bounds import GrammarBounds, check_bounds
from server_process import Server, launch, stop, wait_for, wait_healthy

CORPORA = Path(__file__).resolve().parents[2] / "shared" / "corpora"
COMPILE_S = 2.0
# The defaults, as the server takes them from its config.
BOUNDS = GrammarBounds(*(EngineConfig.model_fields[f"grammar_max_{m}"].default
                         for m in ("size", "repetition", "depth", "alternatives")))
NAMES_A_BOUND = re.compile(r"grammar_max_(size|repetition|depth|alternatives)=\d+")


def _nested(depth: int, inner: str, outer: str) -> str:
    return outer * depth + inner + "}" * depth


def _deep_any_of(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [schema, {"type": "string"}]}
    return schema


BOMBS: list[tuple[str, str, object]] = [
    # regex: counted repetition, nesting, alternation, backtracking-prone shapes
    ("regex a{2000}", "regex", "a{2000}"),
    ("regex a{10000}", "regex", "a{10000}"),
    ("regex a{100000}", "regex", "a{100000}"),
    ("regex a{10**12}", "regex", "a{1000000000000}"),
    ("regex nested counts", "regex", "(a{100}){100}"),
    ("regex triple nested counts", "regex", "(((a{100}){100}){100}){100}"),
    ("regex (a+)+b", "regex", "(a+)+b"),
    ("regex (a|a)*", "regex", "(a|a)*"),
    ("regex (.*a){20}", "regex", "(.*a){20}"),
    ("regex (a|bc){0,40}", "regex", "(a|bc){0,40}"),
    ("regex (x+x+)+y", "regex", "(x+x+)+y"),
    ("regex .{0,5000}", "regex", ".{0,5000}"),
    ("regex (\\w+\\s?){1,500}", "regex", "(\\w+\\s?){1,500}"),
    ("regex 5000 alternatives", "regex", "|".join(f"w{i}" for i in range(5000))),
    ("regex 5000 nested groups", "regex", "(" * 5000 + "a" + ")" * 5000),
    ("regex [a-z]{1,1000}", "regex", "[a-z]{1,1000}"),
    # JSON schema
    ("schema minLength 10**6", "json", {"type": "string", "minLength": 10**6}),
    ("schema maxLength 10**6", "json", {"type": "string", "maxLength": 10**6}),
    ("schema maxItems 10**6 of objects", "json", {"type": "array", "maxItems": 10**6, "items": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}}),
    ("schema nested maxItems", "json", {"type": "array", "maxItems": 1000, "items": {
        "type": "array", "maxItems": 1000, "items": {"type": "string", "maxLength": 1000}}}),
    ("schema 1e5-entry enum", "json", {"enum": [f"v{i}" for i in range(100_000)]}),
    ("schema 1e5 integer enum", "json", {"enum": list(range(100_000))}),
    ("schema 20000 anyOf", "json", {"anyOf": [{"const": f"c{i}"} for i in range(20_000)]}),
    ("schema 3000 optional properties", "json", {"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(3000)}}),
    ("schema $ref to itself", "json", {"$ref": "#"}),
    ("schema $ref cycle", "json", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                   "$ref": "#/$defs/a"}),
    ("schema recursive tree", "json", {"type": "object", "properties": {"kids": {
        "type": "array", "maxItems": 10000, "items": {"$ref": "#"}}}}),
    ("schema 5000 deep (text)", "json", _nested(5000, '{"type":"string"}', '{"type":"array","items":')),
    ("schema 300 deep", "json", json.loads(_nested(300, '{"type":"string"}', '{"type":"array","items":'))),
    ("schema 200 deep anyOf", "json", _deep_any_of(200)),
    ("schema pattern a{100000}", "json", {"type": "string", "pattern": "a{100000}"}),
    ("schema huge integer bounds", "json", {"type": "integer", "minimum": -10**300, "maximum": 10**300}),
    # EBNF / Lark
    ("gbnf a{100000}", "grammar", 'root ::= "a"{100000}'),
    ("gbnf nested counts", "grammar", 'root ::= (("a"{1000}){1000}){1000}'),
    ("gbnf counted rules", "grammar", 'root ::= x{1000}\nx ::= y{1000}\ny ::= "b"'),
    ("gbnf 20000 alternatives", "grammar", "root ::= " + " | ".join(f'"w{i}"' for i in range(20_000))),
    ("gbnf 3000 nested groups", "grammar", "root ::= " + "(" * 3000 + '"a"' + ")" * 3000),
    ("gbnf 2**40 doubling rules", "grammar", "\n".join(
        ["root ::= r0"] + [f"r{i} ::= r{i + 1} r{i + 1}" for i in range(40)] + ['r40 ::= "a"'])),
    ("lark a~100000", "grammar", 'start: "a"~100000'),
    ("lark nested ~", "grammar", 'start: (("a"~1000)~1000)'),
    # choice
    ("choice 1e5 options", "choice", [f"option {i}" for i in range(100_000)]),
    ("choice one 10**6-char option", "choice", ["x" * 10**6]),
]


def _spec(kind: str, value: object):
    return StructuredOutputs(**{kind: value}).spec()


# -- unit: the bounds, and the real backends on what passes them --------------------------
@pytest.fixture(scope="module")
def compiler(llama_dir):
    registry = Registry()
    registry.load_entrypoints({"modserve"})
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(llama_dir).vocab_size
    c = GrammarCompiler(registry, PluginChoice(name="auto"), llama_dir, vocab_size, [2], isolation="thread")
    yield c
    c.close()


def test_the_corpus_has_at_least_30_shapes():
    assert len(BOMBS) >= 30 and len({name for name, _, _ in BOMBS}) == len(BOMBS)


@pytest.mark.parametrize("name, kind, value", BOMBS, ids=[b[0] for b in BOMBS])
def test_a_bomb_is_refused_by_a_bound_or_compiles_quickly(compiler, name, kind, value):
    try:
        spec = _spec(kind, value)
    except ValueError as e:  # not even a spec (too deep to read): refused, saying so
        assert "nests too deeply" in str(e), e
        return
    try:
        check_bounds(spec, BOUNDS)
    except ValueError as e:
        assert NAMES_A_BOUND.search(str(e)), e
        return
    start = time.perf_counter()
    try:
        compiler.compile(spec, timeout=COMPILE_S * 3)  # past it the test fails; the thread is left
    except ValueError:
        pass  # a backend refused it, saying why
    elapsed = time.perf_counter() - start
    assert elapsed < COMPILE_S, f"{name} passed the bounds but took {elapsed:.2f} s to compile"


@pytest.mark.parametrize("regex, repetition, size", [
    ("(a{100}){100}", 10_000, 10_000),
    ("a{3}b{4}", 4, 7),
    ("[a{9}]x", 1, 9),  # inside a class a brace is a character; the class counts 8
    ("\\{9}x", 1, 4),  # an escaped brace is a character, so "{9}" is no count
    ("a{2,}", 2, 2),
    ("a{,5}", 5, 5),
    ("(a|b)*", 1, 2),
    ("a{x}", 1, 4),  # not a count: four characters
])
def test_regex_measures(regex, repetition, size):
    shape = regex_shape(regex)
    assert (shape.repetition, shape.size) == (repetition, size)


def test_only_a_count_over_a_part_of_varying_width_is_variable():
    assert regex_shape("(a|bc){20}").variable_count == 20
    assert regex_shape("(\\w+\\s?){1,5}").variable_count == 5
    assert regex_shape("[a-z]{1,1000}").variable_count == 0
    assert regex_shape("(ab|cd){50}").variable_count == 0


def test_grammar_measures_skip_literals_and_comments():
    shape = grammar_shape('root ::= "a{100000}" x # b{99999}\nx ::= ("y"{10}){20}')
    assert shape.repetition == 200 and shape.depth == 1
    assert grammar_shape('start: "a"~10..30\n%import common.WS').repetition == 30
    assert grammar_shape("start: /[0-9]{1,99}/").repetition == 99


def test_depth_is_measured_on_the_text_before_it_is_parsed():
    assert json_depth('{"a": "[[[[{{", "b": [[1]]}') == 3
    with pytest.raises(ValueError, match="nests 5000 levels deep, over grammar_max_depth=128"):
        check_bounds(GrammarSpec("json", _nested(5000, "1", '{"a":')), BOUNDS)


def test_offline_generate_applies_the_same_bounds(llama_dir):
    from modserve import LLM, SamplingParams

    llm = LLM(llama_dir, progress=False, num_kv_blocks=64, max_model_len=128, num_threads=1,
              grammar_max_repetition=1000)
    bomb = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="a{5000}"))
    with pytest.raises(ValueError, match="repeats a part 5000 times, over grammar_max_repetition=1000"):
        llm.generate("x", bomb, use_tqdm=False)


def _corpus() -> list[tuple[str, object]]:
    if not CORPORA.is_dir():
        pytest.skip(f"shared corpora not found at {CORPORA}")
    found: list[tuple[str, object]] = []
    for f in sorted((CORPORA / "jsonschema" / "jsonschemabench" / "files").glob("*.json")):
        found.append(("json", json.loads(f.read_text())["schema"]))
    for line in (CORPORA / "grammars" / "regex" / "jsonschemabench_patterns.jsonl").read_text().splitlines():
        row = json.loads(line)
        found += [("regex", row[k]) for k in ("pattern", "fullmatch_regex") if row.get(k)]
    for f in sorted((CORPORA / "grammars").glob("*/*.gbnf")) + sorted((CORPORA / "grammars").glob("*/*.lark")):
        found.append(("grammar", f.read_text()))
    return found


def test_every_real_schema_regex_and_grammar_passes_the_bounds():
    corpus = _corpus()
    assert len(corpus) >= 200 + 53 + 8
    for kind, value in corpus:
        check_bounds(_spec(kind, value), BOUNDS)


# -- against a real server -------------------------------------------------------------------
MODEL = "tiny-llama"
VICTIM = {"prompt": "The victim", "temperature": 0.0, "max_tokens": 64, "ignore_eos": True}
RSS_CEILING_MB = 2500  # the server and its compile workers together


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory) -> Server:
    s = launch(tmp_path_factory.mktemp("bombs"), "bombs", "--model", llama_dir, "--served-model-name", MODEL,
               "--num-threads", "1", "--max-model-len", "512", "--num-kv-blocks", "256",
               "--grammar-compile-timeout", "3", "--max-request-body-bytes", str(8 * 2**20))
    try:
        wait_healthy(s)
        yield s
    finally:
        stop(s)


def _body(kind: str, value: object) -> dict:
    field = {"json": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar",
             "choice": "guided_choice"}[kind]
    return {"model": MODEL, "prompt": "x", "max_tokens": 4, field: value}


def _post(server: Server, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.url}/v1/completions", content=content, timeout=60,
                      headers={"Content-Type": "application/json"})


def _stream_text(server: Server, body: dict) -> str:
    text = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices")
                text.append(choices[0]["text"] if choices else "")
    return "".join(text)


def _rss_mb(pid: int) -> float:
    """The resident memory of ``pid`` and its children (the grammar compile workers)."""
    total = 0.0
    for p in [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except FileNotFoundError:  # a worker that just ended
            continue
        total += sum(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024
    return total


def test_the_bombs_at_once_leave_the_server_responsive(server):
    reference = _stream_text(server, VICTIM)
    assert _post(server, _body("regex", "warm")).status_code == 200  # the compile workers are up
    latencies: list[float] = []
    rss: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            start = time.perf_counter()
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
            latencies.append(time.perf_counter() - start)
            rss.append(_rss_mb(server.proc.pid))
            time.sleep(0.25)

    def victims() -> list[str]:  # one greedy stream after another, until the last bomb is answered
        texts = [_stream_text(server, VICTIM)]
        while not done.is_set():
            texts.append(_stream_text(server, VICTIM))
        return texts

    bodies = [(name, _body(kind, value)) for name, kind, value in BOMBS]
    with ThreadPoolExecutor(2) as pool:
        prober, victim = pool.submit(probe), pool.submit(victims)
        with ThreadPoolExecutor(8) as senders:
            replies = list(senders.map(lambda b: (b[0], _post(server, b[1])), bodies))
        done.set()
        texts = victim.result()
        prober.result()
    for name, r in replies:
        assert r.status_code in (200, 400), (name, r.status_code, r.text[:300])
        if r.status_code == 400:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["param"].startswith("guided_"), error
    refused = [name for name, r in replies if r.status_code == 400 and NAMES_A_BOUND.search(r.text)]
    for name, r in replies:
        print(f"{name}: {r.status_code} {r.json()['error']['message'][:120] if r.status_code != 200 else ''}")
    assert len(refused) >= 20, refused
    assert texts == [reference] * len(texts)
    print(f"{len(texts)} victim streams; /health max {max(latencies):.3f} s over {len(latencies)} probes; "
          f"RSS max {max(rss):.0f} MB")
    assert max(latencies) < 1.0
    assert max(rss) < RSS_CEILING_MB


# Class 6: a parser's exception is a 400 naming the field, never a 500 or a dropped connection.
PARSER_CASES = [
    ({"guided_json": _nested(5000, '{"type":"string"}', '{"type":"array","items":')}, "guided_json"),
    ({"guided_json": "[" * 100_000}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(" * 100_000}, "guided_regex"),
    ({"guided_regex": "a{99999999999999999999999}"}, "guided_regex"),
    ({"guided_regex": "a{" + "9" * 10_000 + "}"}, "guided_regex"),
    ({"guided_grammar": "root ::= " + "(" * 50_000 + '"a"'}, "guided_grammar"),
    ({"structured_outputs": {"json": _nested(3000, "1", '{"a":')}}, "structured_outputs"),
    ({"guided_json": json.loads(_nested(900, '{"type":"string"}', '{"type":"array","items":'))}, "guided_json"),
]


@pytest.mark.parametrize("fields, param", PARSER_CASES, ids=range(len(PARSER_CASES)))
def test_a_parser_failure_is_a_400_naming_the_field(server, fields, param):
    with httpx.Client(timeout=60) as client:  # one keep-alive connection: it must survive
        r = client.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                               **fields})
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["param"] == param, r.text[:300]
        assert client.get(f"{server.url}/health").status_code == 200


# Class 7: a constraint that cannot be met, or would not be enforced, is a 400 naming what.
UNMET = [
    ({"guided_regex": "[^\\s\\S]"}, "matches no"),
    ({"guided_regex": "a[^\\s\\S]"}, "[^\\s\\S] matches no character"),
    ({"guided_grammar": "root ::= [^\\u0000-\\U0010FFFF]"}, "matches no text"),
    ({"guided_json": {"type": "string", "pattern": "^[^\\d\\D]$"}}, "matches no character"),
    ({"guided_json": {"enum": []}}, "empty 'enum'"),
    ({"guided_json": {"anyOf": []}}, "empty 'anyOf'"),
    ({"guided_json": {"type": "object", "required": ["a"], "additionalProperties": False}}, "required 'a'"),
    ({"guided_regex": "a$b"}, "anchor $ inside"),
    ({"guided_regex": "\\Aab"}, "anchor \\A inside"),
    ({"guided_regex": "a\\Z"}, "anchor \\Z inside"),
    ({"guided_regex": "\\bab"}, "anchor \\b inside"),
    ({"guided_choice": ["yes", "no"], "min_tokens": 5}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "min_tokens": 5}, "guided_json"),
]


@pytest.mark.parametrize("fields, named", UNMET, ids=range(len(UNMET)))
def test_a_constraint_that_cannot_be_met_is_refused(server, fields, named):
    r = _post(server, {"model": MODEL, "prompt": "x", "max_tokens": 8, **fields})
    assert r.status_code == 400, r.text[:300]
    assert named in r.json()["error"]["message"], r.text[:300]


@pytest.mark.parametrize("regex", ["^ab$", "^(yes|no)$"])
def test_anchors_at_the_very_ends_are_harmless(server, regex):
    r = _post(server, {"model": MODEL, "prompt": "x", "max_tokens": 8, "temperature": 0, "guided_regex": regex})
    assert r.status_code == 200, r.text[:300]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and re.fullmatch(regex, choice["text"]), choice


def test_no_block_leaked(server):
    wait_for(lambda: server.metrics()["modserve_num_requests_running"] == 0, timeout=30)
    assert server.metrics()["modserve_kv_blocks_used"] == 0
