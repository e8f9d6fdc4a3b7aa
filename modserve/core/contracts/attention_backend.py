"""The attention backend's contract (config key ``attention_backend``): the model's attention
shape, one step's batch layout, and the backend that reads and writes the paged KV cache.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import BaseModel


@dataclass(slots=True)
class AttentionSpec:
    """The attention shape of a model, fixed at start-up."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    block_size: int
    dtype: torch.dtype
    device: torch.device
    # What the KV cache stores. A dtype other than ``dtype`` (float8_e4m3fn) holds
    # ``k / k_scale`` and ``v / v_scale``: one scale per cache tensor.
    kv_cache_dtype: torch.dtype | None = None  # None: dtype
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kv_cache_dtype is None:
            self.kv_cache_dtype = self.dtype


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch layout, built once per step and shared by every layer.

    The batch is the concatenation of each sequence's new tokens ("varlen"):
    sequence ``i`` owns query rows ``query_start_loc[i] : query_start_loc[i+1]``,
    at positions ``context_lens[i] .. seq_lens[i] - 1``. A decode is simply a
    sequence with one new token; a (chunked) prefill has several.
    """

    num_tokens: int
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) per new token
    query_start_loc: torch.Tensor  # [B + 1] int64
    query_lens: torch.Tensor  # [B] int64
    context_lens: torch.Tensor  # [B] int64: tokens already in the cache before this step
    seq_lens: torch.Tensor  # [B] int64: context_lens + query_lens
    block_tables: torch.Tensor  # [B, max_blocks] int64, rows padded with 0
    # The same on the host, for backends that loop over sequences.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    context_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)


class CudaGraphSupport(enum.Enum):
    """What of a step a CUDA graph may capture around an attention backend (vLLM's
    ``AttentionCGSupport``): the platform captures no more than the backend declares."""

    NEVER = "never"
    DECODE = "decode"  # steps of decodes only (one new token per sequence), per batch size


class AttentionBackend(ABC):
    """Causal attention over a paged KV cache for a mixed prefill+decode batch.

    Contract: ``forward`` first writes this step's ``k``/``v`` into ``kv_cache``
    at ``meta.slot_mapping``, then returns, for every query row, attention over
    that sequence's keys at positions ``<=`` its own (its cached context plus the
    new tokens), with grouped-query heads (``num_heads % num_kv_heads == 0``).
    Every backend must give the same result as ``reference`` up to float error.
    With a quantized cache (``spec.kv_cache_dtype``), every key and value is read as
    stored, this step's included.

    ``cuda_graphs = DECODE`` promises more, for steps of decodes only: ``prepare`` and
    ``forward`` launch the same work whatever the values in ``meta``'s tensors, for a given
    ``num_seqs`` (a graph replays them on new values). They read nothing per step from the
    host (``*_cpu`` and ``max_seq_len`` hold the worst case, ``max_model_len``, at capture),
    never sync with the device, and a slot of -1 in ``slot_mapping`` writes nowhere (the
    padding rows of a captured batch).
    """

    cuda_graphs: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER

    def __init__(self, spec: AttentionSpec, options: BaseModel | None = None) -> None:
        self.spec = spec
        self.options = options

    def kv_cache_problem(self) -> str | None:
        """Why this backend cannot use a cache of ``spec.kv_cache_dtype``; None if it can.
        Default: it reads only a cache in the compute dtype."""
        if self.spec.kv_cache_dtype != self.spec.dtype:
            return f"{type(self).__name__} reads only a KV cache in the compute dtype ({self.spec.dtype})"
        return None

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache. Default: [2 (k, v), blocks, block_size, kv_heads, head_dim].
        NOTE: dimension 1 must stay the block index: block copies and swaps index it."""
        s = self.spec
        return (2, num_blocks, s.block_size, s.num_kv_heads, s.head_dim)

    def prepare(self, meta: AttentionMetadata) -> Any:
        """Per-step work shared by all layers (index tensors, masks). Result goes to ``forward``."""
        return None

    def native_decode(self) -> str | None:
        """The qualified name of a registered op that does ``forward``'s work for a step of
        decodes only, in sequence order, without ``prepare``: ``(q [T, H, D], k, v [T, Hkv, D],
        kv_cache, slot_mapping [T], block_tables [T, max_blocks], seq_lens [T], scale: float)
        -> [T, H, D]``, writing k, v first. A platform's native decode step calls it with no
        Python around it. Default: None (no such op; the platform keeps the Python forward)."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # kv_cache_shape(num_blocks)
        meta: AttentionMetadata,
        state: Any,
    ) -> torch.Tensor:  # [T, H, D]
        ...
