"""Prompt-lookup speculation: continue the latest earlier occurrence of the sequence's tail."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from modserve.api import Proposal, Proposer, ProposerContext, Sequence


class NgramOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_ngram: int = Field(4, ge=1, description="Longest tail to look up")
    min_ngram: int = Field(1, ge=1, description="Shortest tail worth trusting")


class NgramProposer(Proposer):
    """Looks the sequence's last n tokens up in everything before them (n from
    ``max_ngram`` down to ``min_ngram``) and proposes the tokens that followed the
    latest match. Costs no model call; pays off on repetitive text (code, quoting,
    extraction), proposes nothing when there is no match."""

    def __init__(self, context: ProposerContext, options: NgramOptions | None = None) -> None:
        super().__init__(context, options)
        opts = options or NgramOptions()
        self.max_n, self.min_n = opts.max_ngram, opts.min_ngram

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        return Proposal([self._lookup(np.asarray(s.token_ids, dtype=np.int64), k) for s, k in zip(seqs, num_tokens)])

    def _lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            tail = tokens[L - n :]
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: L - 1], n)  # [L-n, n]
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest match's continuation
                return tokens[start : start + k].tolist()
        return []
