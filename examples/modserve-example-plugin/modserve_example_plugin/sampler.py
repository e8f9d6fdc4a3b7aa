"""typical: every setting a request can give, plus opt-in locally typical sampling.

With ``typical_p`` < 1 (Meister et al., 2022) a random row keeps its tokens whose surprisal
is closest to the entropy, up to ``typical_p`` of the mass: neither the bland head nor the
incoherent tail. No request can ask for that, so it is a deployment-wide choice beyond the
request's own settings; the Sampler contract (and the conformance kit) covers the default,
off. A sampler cannot refuse settings (raising fails the request), so it honours them all.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from modserve.api import Sampler, SamplerOutput, SamplingBatch, add_logprobs, sample_rows

NEG_INF = float("-inf")


class TypicalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    typical_p: float = Field(1.0, gt=0, le=1, description="Below 1: every random row samples from its most "
                             "typical tokens holding this much mass, after its own temperature, top-k/top-p and "
                             "min-p (1, the default: off, exactly the request's settings)")


class TypicalSampler(Sampler):
    def __init__(self, vocab_size: int, options: TypicalOptions | None = None) -> None:
        super().__init__(vocab_size, options)
        self.typical_p = (options or TypicalOptions()).typical_p

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        # Logprobs are of the raw model distribution (the contract), before any mask.
        raw = logits.float().log_softmax(dim=-1) if batch.max_num_logprobs >= 0 else None  # [B, V]
        masked = self._mask(logits, batch)  # [B, V]
        token_ids = masked.argmax(dim=-1)  # [B]: greedy rows take the argmax of the masked logits
        if not batch.all_greedy:  # seeded rows draw only from their own generator
            sampled = sample_rows(self._shape(masked, batch).softmax(dim=-1), batch.generators)
            token_ids = torch.where(batch.temperature == 0, token_ids, sampled)
        out = SamplerOutput(token_ids=token_ids)
        if raw is not None:
            add_logprobs(out, raw, batch.max_num_logprobs)
        return out

    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        return self._shape(self._mask(logits, batch), batch).softmax(dim=-1)  # [B, V]

    def _mask(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Grammar bitmask, banned tokens (min_tokens), penalties: on a float32 copy."""
        x = logits.to(torch.float32, copy=True)  # [B, V]
        B, V = x.shape
        if batch.allowed_token_bitmask is not None:  # bit t % 32 of word t // 32: token t allowed
            shifts = torch.arange(32, dtype=torch.int32, device=x.device)
            allowed = (batch.allowed_token_bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
            x.masked_fill_(allowed.view(B, -1)[:, :V] == 0, NEG_INF)
        for row, ids in batch.banned_token_ids:
            kept = x[row, ids]
            x[row, ids] = NEG_INF
            if not torch.isfinite(x[row]).any():  # the grammar can only end here: it wins
                x[row, ids] = kept
        if not batch.any_penalty:
            return x

        def counts(ids: torch.Tensor) -> torch.Tensor:  # [B, L] padded with vocab_size -> [B, V]
            ids = torch.where(ids >= min(self.vocab_size, V), V, ids)  # padding to a column dropped below
            ones = torch.ones_like(ids, dtype=x.dtype)
            return torch.zeros(B, V + 1, device=x.device).scatter_add_(1, ids, ones)[:, :V]

        output = counts(batch.output_token_ids) if batch.output_token_ids is not None else torch.zeros_like(x)
        seen = output > 0  # repetition penalty (HF): prompt and output; presence/frequency: output only
        if batch.prompt_token_ids is not None:
            seen |= counts(batch.prompt_token_ids) > 0
        rep = batch.repetition_penalty.to(x.dtype)[:, None]  # [B, 1]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)  # towards less likely, either sign
        presence = batch.presence_penalty.to(x.dtype)[:, None]  # [B, 1]
        frequency = batch.frequency_penalty.to(x.dtype)[:, None]  # [B, 1]
        return x - presence * (output > 0) - frequency * output

    def _shape(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Temperature, top-k and top-p, min-p, then typical: the logits random rows sample from."""
        t = batch.temperature.to(x.dtype)[:, None]
        x = x / torch.where(t == 0, 1.0, t)  # greedy rows take the argmax anyway; 1.0 keeps them finite
        if batch.any_top_k or batch.any_top_p:
            x = self._top_k_top_p(x, batch)
        if batch.any_min_p:
            p = x.softmax(dim=-1)
            x = x.masked_fill(p < batch.min_p.to(p.dtype)[:, None] * p.amax(dim=-1, keepdim=True), NEG_INF)
        if self.typical_p < 1:
            logp = x.log_softmax(dim=-1)  # [B, V]; -inf where masked
            entropy = -(logp.exp() * logp).nan_to_num().sum(dim=-1, keepdim=True)  # 0 * -inf: nan -> 0
            x = x.masked_fill(self._past_mass((logp + entropy).abs(), logp.exp(), self.typical_p), NEG_INF)
        return x

    @staticmethod
    def _past_mass(score: torch.Tensor, p: torch.Tensor, mass: torch.Tensor | float) -> torch.Tensor:
        """[B, V] True where a token, taken in increasing ``score``, comes once the better ones
        already hold ``mass`` of ``p``: the best token always stays."""
        order = score.argsort(dim=-1, stable=True)
        sorted_p = p.gather(1, order)
        drop = sorted_p.cumsum(dim=-1) - sorted_p >= mass
        return torch.zeros_like(drop).scatter_(1, order, drop)

    def _top_k_top_p(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        B, V = x.shape
        k = torch.where((batch.top_k <= 0) | (batch.top_k > V), V, batch.top_k)[:, None]  # [B, 1]; off: all
        order = x.argsort(dim=-1, descending=True, stable=True)
        by_rank = torch.arange(V, device=x.device).expand(B, V)  # by position: ties at the k-th keep k
        x = x.masked_fill(torch.zeros_like(x, dtype=torch.bool).scatter_(1, order, by_rank >= k), NEG_INF)
        top_p = batch.top_p.to(x.dtype)[:, None]  # rows at 1.0 keep their tail (cumsum rounding)
        return x.masked_fill(self._past_mass(-x, x.softmax(dim=-1), top_p) & (top_p < 1), NEG_INF)
