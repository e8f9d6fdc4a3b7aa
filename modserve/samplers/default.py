"""The built-in sampler: penalties, temperature, top-k / top-p / min-p, seeded rows.

Everything is batched over rows; the only Python loops are over banned-token
rows and seeded rows, which need per-row work by nature.
"""

from __future__ import annotations

import torch

from modserve.api import Sampler, SamplerOutput, SamplingBatch, add_logprobs, apply_processors, sample_rows

_NEG_INF = float("-inf")
# SamplingParams raises a smaller non-zero temperature to this (vLLM's floor); kept here too
# for batches built around it: far below it logits / t overflow float32 and sampling is garbage.
_MIN_TEMPERATURE = 1e-2


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` ([B, V] -> [B] int64). Float32 logits in a CPU tensor go
    through numpy's argmax: torch 2.13's CPU argmax is many times slower (docs/parallelism.md,
    the core's Python per step). Both take the first of equal maxima and a NaN as the maximum."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not torch.compiler.is_compiling():
        return torch.from_numpy(logits.detach().numpy().argmax(-1))
    return logits.argmax(dim=-1)


def _token_counts(ids: torch.Tensor, vocab_size: int, num_cols: int) -> torch.Tensor:
    """Per-row occurrence counts [B, V] of ``ids`` [B, L]; ids >= vocab_size are padding."""
    B = ids.shape[0]
    # Padding goes to an extra column that is dropped, so no masking pass is needed.
    ids = torch.where(ids >= min(vocab_size, num_cols), num_cols, ids)  # [B, L]
    counts = torch.zeros(B, num_cols + 1, dtype=torch.float32, device=ids.device)  # [B, V+1]
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :num_cols]  # [B, V]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf for every token whose bit is clear in ``bitmask`` [B, ceil(V/32)] int32."""
    B, V = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    # Arithmetic shifts of int32 keep bit 31 (the sign) readable: (-1 >> k) & 1 == 1.
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(B, -1)[:, :V].bool()  # [B, V]
    logits.masked_fill_(~allowed, _NEG_INF)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch, vocab_size: int) -> torch.Tensor:
    """Repetition (HF: prompt + output), presence and frequency (OpenAI: output only)."""
    B, V = logits.shape
    zeros = torch.zeros_like(logits)
    out_counts = (
        _token_counts(batch.output_token_ids, vocab_size, V) if batch.output_token_ids is not None else zeros
    )  # [B, V]
    seen = out_counts > 0  # [B, V] bool
    if batch.prompt_token_ids is not None:
        seen = seen | (_token_counts(batch.prompt_token_ids, vocab_size, V) > 0)
    rep = batch.repetition_penalty.to(logits.dtype).unsqueeze(1)  # [B, 1]
    # HF-style: always move the logit towards "less likely", whatever its sign.
    penalised = torch.where(logits > 0, logits / rep, logits * rep)  # [B, V]
    logits = torch.where(seen, penalised, logits)
    presence = batch.presence_penalty.to(logits.dtype).unsqueeze(1)  # [B, 1]
    frequency = batch.frequency_penalty.to(logits.dtype).unsqueeze(1)  # [B, 1]
    return logits - presence * (out_counts > 0) - frequency * out_counts


def apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus; one sort serves both."""
    B, V = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V] each
    pos = torch.arange(V, device=logits.device).expand(B, V)  # [B, V]
    if batch.any_top_k:
        k = batch.top_k
        k = torch.where((k <= 0) | (k > V), V, k).unsqueeze(1)  # [B, 1]; off -> keep all
        # By sorted position, so ties at the k-th value still keep exactly k tokens.
        sorted_logits = sorted_logits.masked_fill(pos >= k, _NEG_INF)
    if batch.any_top_p:
        probs = sorted_logits.softmax(dim=-1)  # [B, V], after top-k
        before = probs.cumsum(dim=-1) - probs  # [B, V] mass of strictly better tokens
        top_p = batch.top_p.to(probs.dtype).unsqueeze(1)  # [B, 1]
        # Drop a token once the better ones already reach top_p. The first token has
        # before == 0 < top_p, so it always stays; rows with top_p == 1 are skipped to
        # avoid cutting the tail on float rounding of the cumsum.
        drop = (before >= top_p) & (top_p < 1.0)
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = min_p.to(probs.dtype).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, _NEG_INF)


class DefaultSampler(Sampler):
    """Greedy, temperature, top-k, top-p, min-p and penalties, as in vLLM."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if (batch.all_greedy and batch.max_num_logprobs < 0 and batch.allowed_token_bitmask is None
                and not batch.banned_token_ids and not batch.any_penalty and batch.logit_bias is None
                and not batch.logits_processors):
            return SamplerOutput(token_ids=row_argmax(logits))  # nothing to mask: no float32 copy
        # Logprobs are of the raw model distribution, before any processing.
        raw_logprobs = logits.float().log_softmax(dim=-1) if batch.max_num_logprobs >= 0 else None  # [B, V]
        logits = self._mask_and_penalise(logits, batch)
        greedy = row_argmax(logits)  # [B]
        if batch.all_greedy:
            token_ids = greedy
        else:
            sampled = sample_rows(self._shape(logits, batch).softmax(dim=-1), batch.generators)  # [B]
            token_ids = torch.where(batch.temperature == 0, greedy, sampled)

        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            add_logprobs(out, raw_logprobs, batch.max_num_logprobs)
        return out

    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        return self._shape(self._mask_and_penalise(logits, batch), batch).softmax(dim=-1)  # [B, V]

    def _mask_and_penalise(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Token mask, banned tokens, logit bias, logits processors that may change the argmax,
        penalties (vLLM's order): greedy rows take the argmax of this."""
        logits = logits.to(torch.float32, copy=True)  # [B, V]; ours to modify in place
        if batch.allowed_token_bitmask is not None:  # grammar, allowed_token_ids: before anything else
            apply_token_bitmask(logits, batch.allowed_token_bitmask)
        for row, ids in batch.banned_token_ids:
            kept = logits[row, ids]
            logits[row, ids] = _NEG_INF
            if batch.allowed_token_bitmask is not None and not torch.isfinite(logits[row]).any():
                logits[row, ids] = kept  # the mask leaves only these: it wins over min_tokens and bad_words
        if batch.logit_bias is not None:
            rows, ids, biases = batch.logit_bias  # [N] each; one entry per (row, token)
            logits[rows, ids] += biases
        if batch.logits_processors:  # those that may change the argmax: greedy rows too
            logits = apply_processors(logits, batch.logits_processors)
        if batch.any_penalty:
            logits = apply_penalties(logits, batch, self.vocab_size)
        return logits

    def _shape(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Temperature, top-k / top-p, min-p: the logits a random row samples from."""
        temperature = batch.temperature.to(logits.dtype)
        # Greedy rows take the argmax anyway; 1.0 only keeps their maths finite.
        logits = logits / torch.where(temperature == 0, 1.0, temperature.clamp_min(_MIN_TEMPERATURE)).unsqueeze(1)
        if batch.argmax_invariant_processors:  # vLLM's place for them: after temperature, before top-k/top-p
            logits = apply_processors(logits, batch.argmax_invariant_processors)
        if batch.any_top_k or batch.any_top_p:
            logits = apply_top_k_top_p(logits, batch)
        if batch.any_min_p:
            logits = apply_min_p(logits, batch.min_p)
        return logits
