"""Sampling primitives every sampler, proposer and the verifier share: one draw per row,
and the logprob fields of a :class:`~modserve.core.contracts.sampler.SamplerOutput`."""

from __future__ import annotations

import torch

from modserve.core.contracts.sampler import SamplerOutput
from modserve.core.plugin_calls import calling
from modserve.core.sequence import Sequence


def sample_rows(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` [B, V]: argmax(probs / q), q ~ Exp(1), a draw from probs.
    Seeded rows take q only from their own generator, so they do not depend on the batch."""
    B, V = probs.shape
    q = torch.empty_like(probs).exponential_()  # [B, V]
    for row, gen in generators.items():
        q[row] = torch.empty(V, dtype=probs.dtype, device=probs.device).exponential_(generator=gen)
    # exponential_ may return exactly 0; 0/0 = NaN would win argmax, so floor it.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)  # [B]


def add_logprobs(out: SamplerOutput, raw_logprobs: torch.Tensor, num_top: int) -> None:
    """Fill ``out.logprobs`` and ``out.ranks`` for ``out.token_ids`` from ``raw_logprobs``
    [B, V] (the model's unprocessed log-softmax), and with ``num_top`` > 0 the sorted top
    ``num_top`` of each row."""
    token_ids = out.token_ids.unsqueeze(1).to(raw_logprobs.device)  # [B, 1]
    out.logprobs = raw_logprobs.gather(1, token_ids).squeeze(1)  # [B]
    out.ranks = (raw_logprobs > out.logprobs.unsqueeze(1)).sum(dim=-1) + 1  # [B], 1 = most likely
    if num_top > 0:
        out.top_logprobs, out.top_ids = raw_logprobs.topk(min(num_top, raw_logprobs.shape[-1]), dim=-1)  # [B, K]


def fill_token_bitmask(seqs: list[Sequence], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """The step's [B, ceil(V / 32)] int32 mask on ``device``: each constrained row from
    its matcher (matchers fill CPU memory), the other rows all ones; None when no row
    is constrained."""
    rows = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return None
    bitmask = torch.full((len(seqs), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for row, matcher in rows:
        with calling(matcher, "grammar_backend", "matcher.fill_bitmask()"):
            matcher.fill_bitmask(bitmask, row)
    return bitmask.to(device, non_blocking=True)
