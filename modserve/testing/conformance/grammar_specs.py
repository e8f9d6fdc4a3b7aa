"""A tiny byte-level vocabulary, one small constraint per grammar kind, and what each allows.

Every constraint but ``json_object`` has a finite language, listed here, so the tokens that
may come next after any text are known exactly: those whose bytes extend it to a prefix of a
string of the language, and EOS where the text is one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modserve.api import GrammarMatcher, GrammarSpec, GrammarVocab

EOS = 2
# ids 0, 1 and EOS are special (no bytes); then printable ASCII one byte each; then a few
# multi-byte tokens, so a token may cross from one part of a constraint into the next.
TOKEN_BYTES: tuple[bytes | None, ...] = (None, None, None, *(bytes([c]) for c in range(0x20, 0x7F)),
                                         b"ab", b"abc", b"12", b'{"', b'":', b'"}', b"yes", b"no", b"\n")
VOCAB = GrammarVocab(TOKEN_BYTES, (EOS,), "conformance-kit-bytes")
V = VOCAB.vocab_size  # 107: not a multiple of 32


@dataclass(frozen=True)
class KindCase:
    spec: GrammarSpec
    language: frozenset[bytes] | None  # every accepted string; None: not enumerable
    walk: tuple[bytes, ...]  # an accepted string, token by token
    refused_first: bytes  # a token the constraint never starts with


def _regex_language() -> frozenset[bytes]:
    return frozenset({f"ab{i:02d}".encode() for i in range(100)} | {b"xy", b"xz"})


CASES: dict[str, KindCase] = {
    "regex": KindCase(GrammarSpec("regex", r"ab[0-9]{2}|x(y|z)"), _regex_language(), (b"ab", b"1", b"2"), b"b"),
    "choice": KindCase(GrammarSpec("choice", ("yes", "no", "ab|c")), frozenset({b"yes", b"no", b"ab|c"}),
                       (b"ab", b"|", b"c"), b"|"),  # '|' is a literal inside a choice
    "grammar": KindCase(GrammarSpec("grammar", 'root ::= "yes" | "ab" digit\ndigit ::= [1-3]'),
                        frozenset({b"yes", b"ab1", b"ab2", b"ab3"}), (b"a", b"b", b"2"), b"n"),
    "json": KindCase(GrammarSpec("json", '{"enum":["ab","yes"]}'), frozenset({b'"ab"', b'"yes"'}),
                     (b'"', b"ab", b'"'), b"a"),
    "json_object": KindCase(GrammarSpec("json_object", None), None, (b"{", b"}"), b"["),
}
TOKEN_ID = {b: i for i, b in enumerate(TOKEN_BYTES) if b is not None}


def allowed(matcher: GrammarMatcher) -> set[int]:
    """The tokens ``matcher`` allows now: row 1 of a 3-row bitmask, filled with garbage first (it
    must be overwritten), the rows around it checked untouched."""
    words = -(-V // 32)
    bitmask = torch.tensor([[-1] * words, [0x55555555] * words, [0] * words], dtype=torch.int32)
    outside = bitmask[[0, 2]].clone()
    matcher.fill_bitmask(bitmask, 1)
    assert torch.equal(bitmask[[0, 2]], outside), "fill_bitmask(bitmask, 1) changed rows 0 and 2: it owns row 1 only"
    bits = (bitmask[1].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]
    return set(torch.nonzero(bits.flatten()[:V]).flatten().tolist())


def may_follow(language: frozenset[bytes], text: bytes) -> set[int]:
    """Exactly the tokens that may follow ``text``."""
    ok = {t for t, b in enumerate(TOKEN_BYTES) if b and any(w.startswith(text + b) for w in language)}
    return ok | ({EOS} if text in language else set())


def spell(tokens: set[int]) -> list[str]:
    return sorted("EOS" if t == EOS else repr(TOKEN_BYTES[t])[1:] if TOKEN_BYTES[t] else f"<{t}>" for t in tokens)
