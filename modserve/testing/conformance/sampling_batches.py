"""``SamplingBatch`` objects built directly (as the model runner fills them), and the
distributions vLLM's sampling parameters define, computed here from the logits for comparison."""

from __future__ import annotations

import torch

from modserve.api import SamplingBatch


def batch(rows: int, *, temperature: float | list[float] = 1.0, top_k: int = 0, top_p: float = 1.0,
          min_p: float = 0.0, seeds: dict[int, int] | None = None, banned: list[tuple[int, list[int]]] | None = None,
          num_logprobs: int = -1, bitmask: torch.Tensor | None = None) -> SamplingBatch:
    """One setting for every row (``temperature`` may differ per row); flags derived as the runner does."""
    temps = temperature if isinstance(temperature, list) else [temperature] * rows

    def col(value: float | int, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype)

    return SamplingBatch(
        temperature=torch.tensor(temps, dtype=torch.float32), top_k=col(top_k, torch.int64),
        top_p=col(top_p, torch.float32), min_p=col(min_p, torch.float32),
        repetition_penalty=col(1.0, torch.float32), presence_penalty=col(0.0, torch.float32),
        frequency_penalty=col(0.0, torch.float32), all_greedy=all(t == 0 for t in temps),
        any_top_k=top_k > 0, any_top_p=top_p < 1.0, any_min_p=min_p > 0.0, any_penalty=False,
        generators={row: torch.Generator().manual_seed(s) for row, s in (seeds or {}).items()},
        prompt_token_ids=None, output_token_ids=None, banned_token_ids=list(banned or []),
        max_num_logprobs=num_logprobs, allowed_token_bitmask=bitmask)


def expected_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0) -> torch.Tensor:  # [V] float64
    """vLLM's order: temperature, then top-k, then top-p over what top-k kept (the smallest set of
    most likely tokens reaching ``top_p``), then min-p against the most likely token."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        kept = torch.where(keep, probs, 0.0)
        kept = kept / kept.sum()
        before = kept[order].cumsum(0) - kept[order]  # mass of the strictly more likely tokens
        keep[order[before >= top_p]] = False
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def bitmask_of(allowed: list[set[int]], vocab_size: int) -> torch.Tensor:  # [B, ceil(V / 32)] int32
    words = torch.zeros(len(allowed), -(-vocab_size // 32), dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            words[row, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 is the sign bit
