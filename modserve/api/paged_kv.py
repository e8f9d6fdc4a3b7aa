"""Paged-KV arithmetic an attention backend needs: where a token's key and value live.

The cache of one layer is ``[2 (k, v), num_blocks, block_size, Hkv, D]``
(:meth:`AttentionBackend.kv_cache_shape`); flattening the block and offset dimensions
gives one row per *slot*, and token ``pos`` of a sequence sits at slot
``block_table[pos // block_size] * block_size + pos % block_size``. An fp8 cache
(``spec.kv_cache_dtype == float8_e4m3fn``) stores ``e4m3(k / k_scale)``.
"""

from __future__ import annotations

import torch

from modserve.api.fp8 import FP8, to_fp8
from modserve.core.contracts.attention_backend import AttentionMetadata, AttentionSpec


def slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N] cache slots of ``positions`` [N] for a sequence whose block table row is ``block_table``."""
    return block_table[positions // block_size] * block_size + positions % block_size


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
             spec: AttentionSpec) -> None:
    """Store this step's ``k``, ``v`` [T, Hkv, D] at ``meta.slot_mapping`` (quantized for an fp8 cache)."""
    key_cache = kv_cache[0].view(-1, spec.num_kv_heads, spec.head_dim)  # [slots, Hkv, D]
    value_cache = kv_cache[1].view(-1, spec.num_kv_heads, spec.head_dim)
    fp8 = spec.kv_cache_dtype == FP8
    key_cache[meta.slot_mapping] = to_fp8(k, spec.k_scale) if fp8 else k
    value_cache[meta.slot_mapping] = to_fp8(v, spec.v_scale) if fp8 else v


def read_kv(kv_cache: torch.Tensor, at: torch.Tensor, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [N, Hkv, D] at slots ``at`` [N], in ``spec.dtype`` (an fp8 cache scaled back)."""
    keys = kv_cache[0].view(-1, spec.num_kv_heads, spec.head_dim)[at]
    values = kv_cache[1].view(-1, spec.num_kv_heads, spec.head_dim)[at]
    if spec.kv_cache_dtype == FP8:
        keys = (keys.float() * spec.k_scale).to(spec.dtype)
        values = (values.float() * spec.v_scale).to(spec.dtype)
    return keys, values
