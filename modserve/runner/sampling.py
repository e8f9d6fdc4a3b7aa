"""Sampling primitives every sampler, proposer and the verifier share: one draw per row,
and the logprob fields of a :class:`~modserve.core.contracts.sampler.SamplerOutput`; and the
tensors of the requests' token rules (grammar, allowed_token_ids, bad_words, logit_bias)."""

from __future__ import annotations

import numpy as np
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


def token_rule_bitmask(seqs: list[Sequence], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """[B, ceil(V / 32)] int32 (fill_token_bitmask's bits): what each row's allowed_token_ids
    and one-token bad_words leave; None when no row has either. O(ids) per row, not O(V)."""
    rows = [(i, s.params) for i, s in enumerate(seqs) if s.params.allowed_token_ids or s.params.bad_words_token_ids]
    if not rows:
        return None
    mask = np.full((len(seqs), (vocab_size + 31) // 32), 0xFFFFFFFF, dtype=np.uint32)
    for row, p in rows:
        if p.allowed_token_ids:
            mask[row] = 0
            _set_bits(mask[row], p.allowed_token_ids, True)
        _set_bits(mask[row], [ids[0] for ids in p.bad_words_token_ids or () if len(ids) == 1], False)
    return torch.from_numpy(mask.view(np.int32)).to(device)


def _set_bits(words: np.ndarray, ids: list[int], value: bool) -> None:
    """In place: bit t % 32 of ``words[t // 32]`` set (``value``) or cleared for each t of ``ids``."""
    ids = np.asarray(ids, dtype=np.int64)
    bits = (np.int64(1) << (ids & 31)).astype(np.uint32)
    if value:
        np.bitwise_or.at(words, ids >> 5, bits)
    else:
        np.bitwise_and.at(words, ids >> 5, ~bits)


def joined_bitmask(rules: torch.Tensor | None, grammar: torch.Tensor | None) -> torch.Tensor | None:
    """Both masks' tokens ([B, ceil(V / 32)] int32 each), or the one that is not None."""
    if rules is None or grammar is None:
        return grammar if rules is None else rules
    return rules & grammar


def bad_word_rows(seqs: list[Sequence]) -> list[tuple[int, list[list[int]]]]:
    """(row, its bad words of two or more tokens): what each step checks; one-token words are
    in the row's bitmask (token_rule_bitmask)."""
    return [(i, words) for i, s in enumerate(seqs)
            if (words := [w for w in s.params.bad_words_token_ids or () if len(w) > 1])]


def bad_word_bans(seqs: list[Sequence], rows: list[tuple[int, list[list[int]]]]) -> list[tuple[int, list[int]]]:
    """(row, ids) banned this step, vLLM's rule: a word's last token, when the row's output ends
    with the word's other tokens."""
    bans = []
    for row, words in rows:
        seq = seqs[row]
        ids = [w[-1] for w in words if len(w) <= seq.num_output_tokens + 1 and seq.token_ids[1 - len(w):] == w[:-1]]
        if ids:
            bans.append((row, ids))
    return bans


def logit_bias_entries(seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """(rows, token ids, biases), [N] each, of every row's logit_bias; None when no row has one."""
    entries = [(row, t, b) for row, s in enumerate(seqs) if s.params.logit_bias for t, b in s.params.logit_bias.items()]
    if not entries:
        return None
    rows, ids, biases = zip(*entries)
    return (torch.tensor(rows, dtype=torch.int64, device=device), torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(biases, dtype=torch.float32, device=device))


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
