"""``no_repeat_ngram``: a request with ``extra_args={"no_repeat_ngram_size": n}`` (server:
``vllm_xargs``) never generates an n-gram that its prompt and output already hold, as
transformers' ``generate(no_repeat_ngram_size=n)`` (NoRepeatNGramLogitsProcessor).

Each row keeps its tokens and an index from each (n-1)-gram's hash to the positions that
follow it; a step adds only its new tokens and looks up one (n-1)-gram, so a step costs
O(n + matches) per row whatever the length. Hash hits are compared token by token: a
collision bans nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from modserve.api import BatchUpdate, LogitsProcessor, MoveDirectionality, SamplingParams, extra_arg

ARG = "no_repeat_ngram_size"


@dataclass(slots=True)
class _Row:
    n: int
    output: Sequence[int]  # live: grows as the request generates
    tokens: list[int]  # prompt + the output seen so far
    follows: dict[int, list[int]] = field(default_factory=dict)  # hash of an (n-1)-gram -> positions after it
    indexed: int = 0  # positions before this one are in ``follows``

    def catch_up(self, num_prompt: int) -> None:
        for i in range(len(self.tokens) - num_prompt, len(self.output)):
            self.tokens.append(self.output[i])
        n, tokens = self.n, self.tokens
        for p in range(max(self.indexed, n - 1), len(tokens)):
            self.follows.setdefault(hash(tuple(tokens[p - n + 1 : p])), []).append(p)
        self.indexed = len(tokens)

    def banned(self) -> list[int]:
        """The tokens that would complete an n-gram already in the row."""
        n, tokens = self.n, self.tokens
        if len(tokens) < n - 1:
            return []
        prefix = tokens[len(tokens) - n + 1 :]
        return [tokens[p] for p in self.follows.get(hash(tuple(prefix)), ()) if tokens[p - n + 1 : p] == prefix]


class NoRepeatNGram(LogitsProcessor):
    """Bans, in the rows that ask, each token that would repeat an n-gram of the row's tokens."""

    examples = ({ARG: 2}, {ARG: 3}, {ARG: 1})

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rows: dict[int, tuple[_Row, int]] = {}  # batch row -> its state, its prompt's length

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        n = extra_arg(params, ARG)
        if n is not None and (type(n) is not int or n < 1):
            raise ValueError(f"extra_args.{ARG} must be a positive integer, got {n!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # a banned token may be the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            for i in batch_update.removed:
                self.rows.pop(i, None)
            for i, params, prompt, output in batch_update.added:
                n = extra_arg(params, ARG)
                if n:
                    self.rows[i] = (_Row(n, output, list(prompt)), len(prompt))
                else:
                    self.rows.pop(i, None)
            for a, b, how in batch_update.moved:
                row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
                if row_a is not None:
                    self.rows[b] = row_a
                if row_b is not None and how is MoveDirectionality.SWAP:
                    self.rows[a] = row_b
        for row, num_prompt in self.rows.values():
            row.catch_up(num_prompt)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # [B, V]
        rows, ids = [], []
        for i, (row, _) in self.rows.items():
            banned = row.banned()
            rows += [i] * len(banned)
            ids += banned
        if ids:
            logits[torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device)] = float("-inf")
        return logits
