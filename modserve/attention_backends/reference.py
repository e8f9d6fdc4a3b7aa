"""The reference attention backend: slow, short, obviously correct.

Every other backend is tested against this one. It writes the step's k/v into
the paged cache, then for each sequence gathers exactly ``seq_len`` keys/values
from the cache by its block table and runs SDPA with an explicit causal mask.
An fp8 cache stores ``e4m3(k / k_scale)``; reading multiplies the scale back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from modserve.api import AttentionBackend, AttentionMetadata, read_kv, slots, write_kv
from modserve.api.fp8 import FP8


class ReferenceAttention(AttentionBackend):
    """Per-sequence SDPA over KV gathered from the paged cache."""

    def kv_cache_problem(self) -> str | None:
        if self.spec.kv_cache_dtype in (self.spec.dtype, FP8):
            return None
        return f"reference reads a KV cache in the compute dtype or float8_e4m3fn, not {self.spec.kv_cache_dtype}"

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
        group = s.num_heads // s.num_kv_heads
        write_kv(kv_cache, k, v, meta, s)  # 1. this step's keys/values at their slots

        out = torch.empty_like(q)  # [T, H, D]
        start = 0
        for i in range(meta.num_seqs):
            query_len = meta.query_lens_cpu[i]
            context_len = meta.context_lens_cpu[i]
            seq_len = meta.seq_lens_cpu[i]
            if query_len == 0:
                continue

            # 2. Gather the sequence's keys/values at positions 0..seq_len-1.
            pos = torch.arange(seq_len, device=q.device)  # [L]
            keys, values = read_kv(kv_cache, slots(meta.block_tables[i], pos, s.block_size), s)  # [L, Hkv, D]
            keys = keys.to(q.dtype).repeat_interleave(group, dim=1)  # [L, H, D]
            values = values.to(q.dtype).repeat_interleave(group, dim=1)  # [L, H, D]

            # 3. Query row r sits at position context_len + r and sees keys j <= that.
            q_pos = context_len + torch.arange(query_len, device=q.device)  # [Lq]
            mask = pos[None, :] <= q_pos[:, None]  # [Lq, L]

            o = F.scaled_dot_product_attention(
                q[start : start + query_len].transpose(0, 1),  # [H, Lq, D]
                keys.transpose(0, 1),  # [H, L, D]
                values.transpose(0, 1),  # [H, L, D]
                attn_mask=mask,
                scale=s.scale,
            )  # [H, Lq, D]
            out[start : start + query_len] = o.transpose(0, 1)
            start += query_len
        return out
