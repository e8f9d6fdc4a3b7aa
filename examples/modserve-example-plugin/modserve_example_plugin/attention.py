"""example_sdpa: causal attention over the paged KV cache, one SDPA call per sequence.

The reference backend's algorithm, written only against ``modserve.api``: write the step's
keys/values into the cache, then for each sequence gather all of its keys/values from its
blocks and attend. Grouped-query heads are broadcast inside SDPA (``enable_gqa``) rather
than copied ``num_heads // num_kv_heads`` times, unless ``gqa: repeat`` asks for the copy.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from modserve.api import FP8, AttentionBackend, AttentionMetadata, AttentionSpec, read_kv, slots, write_kv


class ExampleSDPAOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelled option fails at start-up, not silently
    gqa: Literal["enable_gqa", "repeat"] = Field(
        "enable_gqa", description="How KV heads reach their query heads: SDPA's broadcast (no copy), "
        "or repeat_interleave (a copy, for SDPA kernels without enable_gqa)")


class ExampleSDPA(AttentionBackend):
    def __init__(self, spec: AttentionSpec, options: ExampleSDPAOptions | None = None) -> None:
        super().__init__(spec, options)
        self.repeat = (options or ExampleSDPAOptions()).gqa == "repeat"

    def kv_cache_problem(self) -> str | None:
        # read_kv scales an fp8 cache back to the compute dtype, so both stored forms work.
        if self.spec.kv_cache_dtype in (self.spec.dtype, FP8):
            return None
        return f"example_sdpa reads a KV cache in the compute dtype or {FP8}, not {self.spec.kv_cache_dtype}"

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        state: Any,
    ) -> torch.Tensor:  # [T, H, D]
        s = self.spec
        # First, so the reads below see this step's keys as stored (an fp8 cache rounds them).
        write_kv(kv_cache, k, v, meta, s)
        out = torch.empty_like(q)
        starts = accumulate(meta.query_lens_cpu, initial=0)  # first query row of each sequence
        rows = zip(starts, meta.query_lens_cpu, meta.context_lens_cpu, meta.seq_lens_cpu)
        for i, (start, query_len, context_len, seq_len) in enumerate(rows):
            if query_len == 0:
                continue
            # The sequence's keys/values at positions 0..seq_len-1: its context and this step's rows.
            pos = torch.arange(seq_len, device=q.device)  # [L]
            keys, values = read_kv(kv_cache, slots(meta.block_tables[i], pos, s.block_size), s)  # [L, Hkv, D]
            if self.repeat:
                keys = keys.repeat_interleave(s.num_heads // s.num_kv_heads, dim=1)  # [L, H, D]
                values = values.repeat_interleave(s.num_heads // s.num_kv_heads, dim=1)
            # Query row r sits at position context_len + r and sees keys at positions <= that.
            # A decode row (one query, the last position) sees every key: no mask to build.
            q_pos = context_len + torch.arange(query_len, device=q.device)  # [Lq]
            mask = None if query_len == 1 else pos[None, :] <= q_pos[:, None]  # [Lq, L]
            o = F.scaled_dot_product_attention(
                q[start:start + query_len].transpose(0, 1),  # [H, Lq, D]
                keys.transpose(0, 1), values.transpose(0, 1),  # [Hkv or H, L, D]
                attn_mask=mask, scale=s.scale, enable_gqa=not self.repeat)  # [H, Lq, D]
            out[start:start + query_len] = o.transpose(0, 1)
        return out
