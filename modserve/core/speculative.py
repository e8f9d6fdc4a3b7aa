"""Verifying speculative proposals: rejection sampling that keeps the target distribution.

For each sequence the target model scored its last token plus ``k`` draft tokens
in one forward pass, giving ``k + 1`` target distributions ``p_0 .. p_k``. Draft
token ``d_j`` (drawn from the draft's ``q_j``) is accepted with probability
``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the replacement is drawn
from ``normalise(max(0, p_j - q_j))``; when all ``k`` are accepted a bonus token
is drawn from ``p_k``. The emitted tokens then follow the target distribution
exactly (Leviathan et al. 2023; Chen et al. 2023). Greedy rows accept exactly
while the draft equals the target's argmax, then emit the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modserve.core.sampling import sample_rows


@dataclass(slots=True)
class Verified:
    num_accepted: list[int]  # per sequence, how many draft tokens were accepted
    token_ids: list[list[int]]  # per sequence, the emitted tokens: accepted drafts + one more


def uniform_rows(shape: tuple[int, int], generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
    u = torch.rand(shape, device=device)  # [B, K]
    for row, gen in generators.items():
        u[row] = torch.rand(shape[1], device=device, generator=gen)
    return u


def verify(
    target_probs: torch.Tensor,  # [B, K + 1, V] processed target distributions
    draft_tokens: torch.Tensor,  # [B, K] int64, padded
    num_drafts: list[int],  # per row, valid drafts (<= K)
    draft_probs: torch.Tensor | None,  # [B, K, V]; None: drafts are deterministic (one-hot q)
    greedy: torch.Tensor,  # [B] bool
    generators: dict[int, torch.Generator],
) -> Verified:
    B, K1, V = target_probs.shape
    K = K1 - 1
    dev = target_probs.device
    valid = torch.arange(K, device=dev).unsqueeze(0) < torch.tensor(num_drafts, device=dev).unsqueeze(1)  # [B, K]
    p = target_probs[:, :K]  # [B, K, V]
    p_d = p.gather(2, draft_tokens.unsqueeze(2)).squeeze(2)  # [B, K]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
    else:
        q_d = draft_probs.gather(2, draft_tokens.unsqueeze(2)).squeeze(2)  # [B, K]
    u = uniform_rows((B, K), generators, dev)
    accept = u * q_d < p_d  # u < p/q without dividing by a zero q
    target_argmax = target_probs.argmax(dim=2)  # [B, K+1]
    accept = torch.where(greedy.unsqueeze(1), target_argmax[:, :K] == draft_tokens, accept) & valid
    # leading accepts: position of the first False (K if none)
    num_accepted = torch.cumprod(accept.int(), dim=1).sum(dim=1)  # [B]

    # The distribution of the token after the accepted drafts, per row.
    rows = torch.arange(B, device=dev)
    next_p = target_probs[rows, num_accepted]  # [B, V]
    rejected = num_accepted < torch.tensor(num_drafts, device=dev)  # [B]
    if draft_probs is None:
        q_next = torch.zeros_like(next_p)
        idx = draft_tokens.gather(1, num_accepted.clamp(max=max(K - 1, 0)).unsqueeze(1)) if K else None
        if idx is not None:
            q_next.scatter_(1, idx, 1.0)
    else:
        q_next = draft_probs[rows, num_accepted.clamp(max=max(K - 1, 0))] if K else torch.zeros_like(next_p)
    residual = (next_p - q_next).clamp_(min=0)  # [B, V]
    mass = residual.sum(dim=1, keepdim=True)
    # NOTE: a zero residual means p <= q everywhere, i.e. p == q: then p itself is right.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), next_p)
    dist = torch.where(rejected.unsqueeze(1), residual, next_p)
    sampled = sample_rows(dist, generators)  # [B]
    final = torch.where(greedy, target_argmax[rows, num_accepted], sampled)

    accepted_list = num_accepted.tolist()
    drafts = draft_tokens.tolist()
    finals = final.tolist()
    tokens = [drafts[b][: accepted_list[b]] + [finals[b]] for b in range(B)]
    return Verified(accepted_list, tokens)
