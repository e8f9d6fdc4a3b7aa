"""Grammar backend on xgrammar: JSON schema, regex, EBNF/GBNF or Lark grammars, choice, any JSON object."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from modserve.api import GrammarBackend, GrammarMatcher, GrammarSpec, GrammarVocab
from modserve.plugins.grammars.byte_guard import ByteGuard
from modserve.plugins.grammars.dialect import (anchor, dot_excludes_newline, empty_class,
                                                fill_empty_alternatives)
from modserve.plugins.grammars.schema_gate import unenforced, unmet

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: ".
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
# Accepted by xgrammar 0.2 but not enforced (oneOf: when branches may overlap; allOf: with 2+ branches).
SKIPPED_KEYWORDS = frozenset({"uniqueItems", "not", "if", "dependentRequired", "dependencies", "allOf", "oneOf"})
SKIPPED_FORMATS = frozenset({"regex", "idn-email", "idn-hostname"})
SKIPPED_PAIRS = frozenset({("pattern", "minLength"), ("pattern", "maxLength")})  # it warns, then drops the lengths


class XGrammarOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    any_whitespace: bool = Field(
        False, description="JSON: allow any whitespace between tokens. Off (the default) writes compact "
        "JSON with single spaces after ',' and ':'; random or weak models otherwise emit spaces forever")
    max_whitespace_cnt: int | None = Field(
        None, ge=1, description="JSON with any_whitespace: at most this many whitespace characters in a row")
    strict_mode: bool = Field(
        True, description="JSON: no properties or items beyond those the schema names, unless it allows them")
    max_threads: int = Field(2, ge=1, description="threads xgrammar uses to compile one grammar")
    refuse_unenforced: bool = Field(
        True, description="JSON: refuse schemas using keywords the library would not enforce (see "
        "docs/guided-decoding.md); off compiles them anyway, and outputs may then fail validation")


@dataclass(frozen=True, slots=True)
class _Compiled:
    grammar: Any  # xgrammar.CompiledGrammar
    guard: ByteGuard


class XGrammarBackend(GrammarBackend):
    kinds = frozenset({"json", "regex", "choice", "grammar", "json_object"})

    def __init__(self, vocab: GrammarVocab, options: XGrammarOptions | None = None) -> None:
        super().__init__(vocab, options or XGrammarOptions())
        import xgrammar as xgr

        self.xgr = xgr
        # Bytes per token (empty = special: never inside a grammar), as the core computed them.
        encoded = [b or b"" for b in vocab.token_bytes]
        self.info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
                                      stop_token_ids=list(vocab.eos_token_ids))
        # NOTE: xgrammar's own cache is off: the core's cache is the one place a grammar is kept.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=self.options.max_threads, cache_enabled=False)
        self.text_guard = ByteGuard(vocab, json=False)
        self.json_guard = ByteGuard(vocab, json=True)

    def compile(self, spec: GrammarSpec) -> _Compiled:
        if spec.kind == "json":
            schema = json.loads(spec.value)
            if problem := unmet(schema):
                raise ValueError(f"cannot meet {problem}")
            skipped = self.options.refuse_unenforced and unenforced(
                schema, SKIPPED_KEYWORDS, SKIPPED_FORMATS, SKIPPED_PAIRS, pointer_refs_only=True)
            if skipped:
                raise ValueError(f"does not enforce {skipped}")
        if spec.kind == "regex" and (found := empty_class(spec.value)):
            raise ValueError(f"the character class {found} matches no character: no text matches the regex")
        if spec.kind == "regex" and (found := anchor(spec.value)):
            raise ValueError(f"does not support the anchor {found} inside a regex (the regex matches the "
                             "whole output: '^' may only come first and '$' last)")
        try:
            grammar = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(_CPP_PREFIX.sub("", str(e)).strip()) from None
        # A grammar whose first step allows nothing matches no text at all ("[^\\s\\S]"): refused
        # here, where the request can still get a 400, rather than ended mid-way.
        matcher = self.xgr.GrammarMatcher(grammar)
        first = self.xgr.allocate_token_bitmask(1, self.vocab.vocab_size)
        matcher.fill_next_token_bitmask(first)
        if not matcher.is_terminated() and not first.any():
            raise ValueError(f"the {spec.kind} constraint matches no text")
        return _Compiled(grammar, self.json_guard if spec.kind in ("json", "json_object") else self.text_guard)

    def _compile(self, spec: GrammarSpec) -> Any:
        c, opts = self.compiler, self.options
        if spec.kind in ("json", "json_object"):
            schema = spec.value if spec.kind == "json" else '{"type": "object"}'
            return c.compile_json_schema(schema, any_whitespace=opts.any_whitespace, strict_mode=opts.strict_mode,
                                         max_whitespace_cnt=opts.max_whitespace_cnt if opts.any_whitespace else None)
        if spec.kind == "regex":
            return c.compile_regex(dot_excludes_newline(spec.value))
        if spec.kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(ebnf_literal(s) for s in spec.value))
        if "::=" in spec.value:
            return c.compile_grammar(fill_empty_alternatives(spec.value))
        # No "::=" rule: Lark syntax (a ``start`` rule, %import common.*), which xgrammar also reads.
        return c.compile_grammar(self.xgr.Grammar.from_lark(spec.value))

    def serialize(self, compiled: _Compiled) -> bytes:
        # xgrammar's CompiledGrammar does not pickle; the guard is rebuilt from this backend's own.
        head = b"J" if compiled.guard is self.json_guard else b"T"
        return head + compiled.grammar.serialize_json().encode()

    def deserialize(self, data: bytes) -> _Compiled:
        grammar = self.xgr.CompiledGrammar.deserialize_json(data[1:].decode(), self.info)
        return _Compiled(grammar, self.json_guard if data[:1] == b"J" else self.text_guard)

    def matcher(self, compiled: _Compiled, max_rollback: int) -> GrammarMatcher:
        # xgrammar's matchers roll back any number of tokens (max_rollback_tokens is deprecated).
        return XGrammarMatcher(self.xgr.GrammarMatcher(compiled.grammar), compiled.guard)


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any, guard: ByteGuard) -> None:
        self.m = matcher
        self.guard = guard
        self.ends_with_ed: list[bool] = []  # per accepted token, for the guard and for rollback

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)
        self.guard.restrict(bitmask[row], bool(self.ends_with_ed) and self.ends_with_ed[-1])

    def accept_token(self, token_id: int) -> bool:
        if not self.m.accept_token(token_id):
            return False
        self.ends_with_ed.append(bool(self.guard.ends_with_ed[token_id]))
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.m.rollback(num_tokens)
            del self.ends_with_ed[-num_tokens:]

    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    def reset(self) -> None:
        self.m.reset()
        self.ends_with_ed.clear()


def ebnf_literal(text: str) -> str:
    """``text`` as an xgrammar EBNF string literal."""
    named = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    out = []
    for ch in text:
        if ch in named:
            out.append(named[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")  # fixed width: a following hex digit can't extend it
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
