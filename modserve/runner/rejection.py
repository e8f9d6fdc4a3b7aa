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

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

from modserve.core.contracts.sampler import Sampler, SamplerOutput, SamplingBatch
from modserve.core.plugin_calls import calling, checked_probs
from modserve.core.sequence import Sequence
from modserve.runner.sampling import add_logprobs, joined_bitmask, sample_rows, token_rule_bitmask


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


class Verifier(Protocol):
    """What verifying drafts reads of the target's runner."""

    device: torch.device
    vocab_size: int
    sampler: Sampler

    def sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch: ...


def verify_drafts(runner: Verifier, seqs: list[Sequence], drafts: list[list[int]],
                  draft_probs: list[torch.Tensor | None],
                  logits: torch.Tensor) -> tuple[list[list[int]], SamplerOutput]:
    """Rejection-sample each sequence's drafts against the target. ``logits`` [R, V] hold, per
    sequence, the rows of its last real token and of each draft; ``draft_probs[i]`` [k_i, V]
    the distributions sequence i's drafts were drawn from (None: one-hot). Returns per
    sequence the emitted tokens (accepted drafts and one more) and one output row per
    emitted token, with the raw logprobs of the row it was drawn from."""
    counts = [1 + len(d) for d in drafts]
    K = max(counts) - 1
    starts = [0, *itertools.accumulate(counts)][:-1]
    dev = runner.device
    # Each row's processed distribution, with its sequence's settings.
    repeated = [s for s, c in zip(seqs, counts) for _ in range(c)]
    rep = runner.sampling_batch(repeated)
    if any(s.grammar is not None for s in seqs):  # the rows' own token rules hold at every position
        drafted = _draft_bitmask(seqs, drafts, starts, sum(counts), runner.vocab_size, dev)
        rep.allowed_token_bitmask = joined_bitmask(token_rule_bitmask(repeated, runner.vocab_size, dev), drafted)
    with calling(runner.sampler, "sampler", "probs()"):
        probs = checked_probs(runner.sampler, runner.sampler.probs(logits, rep), logits)  # [R, V]
    pos = torch.tensor([[st + min(j, c - 1) for j in range(K + 1)] for st, c in zip(starts, counts)],
                       device=dev)  # [B, K+1] rows, the last repeated as padding
    padded = torch.tensor([d + [0] * (K - len(d)) for d in drafts], device=dev)  # [B, K]
    q = None
    if any(p is not None for p in draft_probs):
        q = torch.zeros(len(seqs), K, probs.shape[1], device=dev)  # [B, K, V]
        for b, (d, p) in enumerate(zip(drafts, draft_probs)):
            q[b, : len(d)] = p if p is not None else \
                torch.nn.functional.one_hot(torch.tensor(d, device=dev), probs.shape[1])
    batch = runner.sampling_batch(seqs)
    verified = verify(probs[pos], padded, [c - 1 for c in counts], q, batch.temperature == 0, batch.generators)
    # Per emitted token, the raw logprobs of the row it was drawn from.
    emitted = [st + j for st, toks in zip(starts, verified.token_ids) for j in range(len(toks))]
    out = SamplerOutput(token_ids=torch.tensor([t for toks in verified.token_ids for t in toks]))
    if batch.max_num_logprobs >= 0:
        add_logprobs(out, logits[emitted].float().log_softmax(dim=-1), batch.max_num_logprobs)  # [E, V]
    return verified.token_ids, out


def _draft_bitmask(seqs: list[Sequence], drafts: list[list[int]], starts: list[int], num_rows: int,
                   vocab_size: int, device: torch.device) -> torch.Tensor:
    """Grammar masks for verification: the row of draft position j holds the grammar
    state after the first j drafts (drafts were checked against it when proposed)."""
    mask = torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for seq, tokens, start in zip(seqs, drafts, starts):
        matcher = seq.grammar
        if matcher is None:
            continue
        for j, token in enumerate([None, *tokens]):
            if token is not None:
                matcher.accept_token(token)
            if not matcher.is_terminated():  # past the end every token is dropped anyway
                matcher.fill_bitmask(mask, start + j)
        matcher.rollback(len(tokens))
    return mask.to(device, non_blocking=True)
