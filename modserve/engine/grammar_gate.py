"""A constraint that starts after a token sequence: structured output after reasoning.

With a reasoning parser, the server asks for the constraint to hold only once the model
has written the reasoning's end marker (``</think>``, as token ids:
``StructuredOutputs.start_after``), as vLLM applies it. Until then every token is allowed
and the inner matcher stays at its start; the marker's last token arms it.
"""

from __future__ import annotations

import torch

from modserve.core.contracts.grammar_backend import GrammarMatcher


class AfterMarker(GrammarMatcher):
    """``inner`` gated by ``marker``: the GrammarMatcher contract, with rollback across the
    point where the marker completed (speculative decoding rolls drafts back)."""

    def __init__(self, inner: GrammarMatcher, marker: tuple[int, ...]) -> None:
        if not marker:
            raise ValueError("start_after must hold at least one token id")
        self.inner, self.marker = inner, list(marker)
        self.tokens: list[int] = []  # every token accepted, before the marker and after
        self.start: int | None = None  # len(tokens) when the marker completed; None: not yet

    @property
    def active(self) -> bool:
        return self.start is not None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.start is None:
            bitmask[row] = -1  # all bits set: any token, EOS included (reasoning may end the output)
        else:
            self.inner.fill_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if self.start is None:
            self.tokens.append(token_id)
            if self.tokens[-len(self.marker):] == self.marker:
                self.start = len(self.tokens)
            return True
        if not self.inner.accept_token(token_id):
            return False
        self.tokens.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        keep = len(self.tokens) - num_tokens
        if self.start is not None:
            undone = len(self.tokens) - max(self.start, keep)  # of the tokens the inner matcher took
            if undone > 0:
                self.inner.rollback(undone)
            if keep < self.start:
                self.start = None
        del self.tokens[keep:]

    def is_terminated(self) -> bool:
        return self.start is not None and self.inner.is_terminated()

    def reset(self) -> None:
        self.inner.reset()
        self.tokens.clear()
        self.start = None


def gated(inner: GrammarMatcher, start_after: tuple[int, ...] | None) -> GrammarMatcher:
    return inner if not start_after else AfterMarker(inner, start_after)
