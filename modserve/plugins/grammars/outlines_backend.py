"""Grammar backend on outlines-core: JSON schema, regex and choice as a token-level DFA.

outlines-core only knows regular languages: a JSON schema becomes a regex first
(bounded recursion), and EBNF grammars are refused. Its ``Vocabulary`` is built
here from the core's bytes per token (``Vocabulary.from_pretrained`` takes a Hub
model name; this works for any local tokenizer and matches what xgrammar sees).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from modserve.api import GrammarBackend, GrammarMatcher, GrammarSpec, GrammarVocab
from modserve.plugins.grammars.bits import set_bit
from modserve.plugins.grammars.dialect import ascii_classes
from modserve.plugins.grammars.expansion import regex_shape
from modserve.plugins.grammars.schema_gate import unenforced, unmet

_REGEX_META = set("\\.+*?()|[]{}^$")
# Accepted by outlines-core 0.2 but not enforced (oneOf: when branches may overlap; allOf, which it
# concatenates: with two or more branches).
SKIPPED_KEYWORDS = frozenset({"allOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                              "uniqueItems", "contains", "minContains", "maxContains", "minProperties",
                              "maxProperties", "patternProperties", "propertyNames", "dependentRequired",
                              "dependencies", "dependentSchemas", "oneOf"})


class OutlinesOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    whitespace_pattern: str = Field(
        r"[ ]?", description="JSON: regex for the whitespace allowed between tokens (bounded by default)")
    max_recursion_depth: int = Field(3, ge=0, description="JSON: how deep recursive schemas ($ref) unroll")
    refuse_unenforced: bool = Field(
        True, description="JSON: refuse schemas using keywords the library would not enforce (see "
        "docs/guided-decoding.md); off compiles them anyway, and outputs may then fail validation")
    max_positions: int = Field(
        8192, ge=1, description="Refuse a regex (a schema's or choice list's too) that expands to more DFA "
        "positions than this (counted repetitions multiplied out, a character class as 8): the DFA's "
        "size, and its compile time and memory, grow with it")
    max_variable_count: int = Field(
        8, ge=1, description="Refuse a counted repetition over a part of varying width with a larger count "
        "((a|bc){20}, a JSON string's maxLength): its DFA grows exponentially with the count")


class OutlinesBackend(GrammarBackend):
    # NOTE: no json_object: "any JSON object" unrolled into a regex takes ~30 s to compile.
    kinds = frozenset({"json", "regex", "choice"})

    def __init__(self, vocab: GrammarVocab, options: OutlinesOptions | None = None) -> None:
        super().__init__(vocab, options or OutlinesOptions())
        import outlines_core

        self.oc = outlines_core
        eos = set(vocab.eos_token_ids)
        if not eos:
            raise ValueError("the tokenizer has no EOS token; outlines-core needs one")
        tokens: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab.token_bytes):
            if b and i not in eos:  # several ids may spell the same bytes
                tokens.setdefault(b, []).append(i)
        # NOTE: outlines-core takes one EOS id; the matcher allows the others where that one is.
        self.vocabulary = outlines_core.Vocabulary(min(eos), tokens)

    def compile(self, spec: GrammarSpec) -> Any:
        regex = ascii_classes(self.regex(spec))
        shape, opts = regex_shape(regex), self.options
        if shape.size > opts.max_positions:
            raise ValueError(f"the regex expands to about {shape.size} DFA positions, over "
                             f"max_positions={opts.max_positions}")
        if shape.variable_count > opts.max_variable_count:
            raise ValueError(f"the regex repeats a part of varying width {shape.variable_count} times, over "
                             f"max_variable_count={opts.max_variable_count}")
        try:
            return self.oc.Index(regex, self.vocabulary)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"could not compile the regex: {e}") from None

    def regex(self, spec: GrammarSpec) -> str:
        if spec.kind == "regex":
            return spec.value
        if spec.kind == "choice":
            return "(" + "|".join(regex_literal(c) for c in spec.value) + ")"
        if problem := unmet(json.loads(spec.value)):
            raise ValueError(f"cannot meet {problem}")
        # NOTE: for {} as a member, outlines-core writes an ungrouped alternation: `{1}` then matches.
        skipped = self.options.refuse_unenforced and unenforced(json.loads(spec.value), SKIPPED_KEYWORDS,
                                                                type_from_keywords=True, empty_members=True)
        if skipped:
            raise ValueError(f"does not enforce {skipped}")
        try:
            return self.oc.json_schema.build_regex_from_schema(
                spec.value, self.options.whitespace_pattern, self.options.max_recursion_depth)
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(str(e)) from None

    def matcher(self, compiled: Any, max_rollback: int) -> GrammarMatcher:
        return OutlinesMatcher(self.oc.Guide(compiled, max_rollback=max_rollback), self.vocab.eos_token_ids)


class OutlinesMatcher(GrammarMatcher):
    def __init__(self, guide: Any, eos_token_ids: tuple[int, ...]) -> None:
        self.guide = guide
        self.eos = eos_token_ids
        self.terminated = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        self.guide.write_mask_into(words.data_ptr(), words.numel(), 4)
        if self.guide.is_finished():  # a final state: every EOS id may end it
            for eos in self.eos:
                set_bit(words, eos)

    def accept_token(self, token_id: int) -> bool:
        if self.terminated:
            return False
        if token_id in self.eos:
            self.terminated = self.guide.is_finished()
            return self.terminated
        try:
            self.guide.advance(token_id, return_tokens=False)
        except ValueError:  # no transition: the guide is unchanged
            return False
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self.terminated:
            self.terminated = False  # the EOS never entered the guide
            num_tokens -= 1
        if num_tokens:
            self.guide.rollback_state(num_tokens)

    def is_terminated(self) -> bool:
        return self.terminated

    def reset(self) -> None:
        self.guide.reset()
        self.terminated = False


def regex_literal(text: str) -> str:
    """``text`` as a regex matching exactly it (escapes only what every dialect reads as meta)."""
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)
