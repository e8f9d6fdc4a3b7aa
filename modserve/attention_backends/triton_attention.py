"""The triton attention backend: Triton kernels over the paged KV cache, for GPUs.

Cache layout: the default ``[2 (k, v), num_blocks, block_size, Hkv, D]``, read and written in
place through its strides; an fp8 cache holds ``e4m3(k / k_scale)``, ``e4m3(v / v_scale)``.

A step is two launches or three (:mod:`.triton_kernels`):

1. ``write``: one small kernel stores this step's k/v at ``slot_mapping``; a slot of -1
   writes nowhere. For fp8, ``to_fp8`` converts in torch first and the kernel copies raw
   bytes (uint8 views), so the cache's bits are exactly what ``reference`` writes.
2. ``attend``, for any mixed batch (prefills, chunked prefills over cached context, decodes):
   one kernel, grid ``(num_tokens // BLOCK_Q + num_seqs, Hkv)``. A program takes BLOCK_Q
   consecutive query tokens of one sequence (found by a binary search over the query start
   offsets; the grid's extra programs return) times the ``G = H / Hkv`` query heads of one KV
   head: ``BLOCK_Q * G`` rows (G padded to a power of two), so each key tile is read once per
   group and KV is never repeated. Keys come TILE_N at a time straight from the cache, each
   through the block table (so any block size works), up to the last key the program's rows
   can see; query row r sits at position ``context_len + r`` and sees keys ``j <= that``.
   Softmax is online, in float32; head sizes are padded to a power of two with masks.
   Tiles: BLOCK_Q * G = 64 rows for prefills (as few as tl.dot's 16 allow in decode steps)
   and TILE_N = 64 keys; in float32 on a GPU 16 and 32, since an fp32 dot runs on CUDA cores
   with its whole tile in registers (ptxas spills at 64 x 64); 8 warps past head size 128.
3. Decode-only steps may split each decode's keys into ``num_splits`` slices instead (more
   programs when there are few decodes with long contexts: a GPU would otherwise idle): grid
   ``(num_seqs, Hkv, num_splits)`` writes per-slice outputs, maxima and sums to float32
   workspaces, and a reduce kernel combines them by log-sum-exp. Auto on CUDA: about two
   programs per SM, each slice at least a few tiles of the longest sequence; on CPU: 1.

fp8: keys and values are read as bytes and bitcast in the kernel; ``k_scale`` is folded into
the softmax scale and ``v_scale`` into the output: ``softmax(q (ks k8)^T s) (vs v8) = vs
softmax(q k8^T (ks s)) v8``. The scales are read at every ``forward`` (the core may set them
after ``__init__``).

CUDA graphs (``cuda_graphs = DECODE``): ``prepare`` converts the metadata with device ops only
(int32 copies of the offsets and lengths), and every launch's grid and workspace depends on
``num_tokens``, ``num_seqs``, ``max_query_len``, the bound ``max_seq_len``, the spec and the
options, never on tensor values: split sizes and loop lengths are computed in the kernels from
``seq_lens``. Nothing reads the ``*_cpu`` lists.

On CPU the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1`` set before the
process starts): slow, for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, Field, field_validator

from modserve.api import AttentionBackend, AttentionMetadata, AttentionSpec, CudaGraphSupport
from modserve.api.fp8 import FP8, to_fp8

COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PROGRAMS_PER_SM = 2  # split-KV decode aims at this many programs per SM
MIN_SPLIT_TILES = 4  # a slice of a decode's keys spans at least this many tiles of the longest one
MAX_SPLITS = 64


class TritonOptions(BaseModel):
    decode_splits: int | None = Field(
        None, ge=1, le=MAX_SPLITS,
        description="Slices of each decode's keys in decode-only steps (split-KV); None: auto "
        "(enough programs to fill the GPU; 1 on CPU); 1: never split")
    block_m: int | None = Field(
        None, description="Query rows (tokens x the query heads of one KV head) per program in steps with "
        "prefills; a power of two >= 16. None: 64, or 16 in float32 on a GPU")
    tile_n: int | None = Field(
        None, description="Keys per tile of the inner loop; a power of two >= 16. None: 64, or 32 in float32 on a GPU")

    @field_validator("block_m", "tile_n")
    @classmethod
    def _power_of_two(cls, value: int | None) -> int | None:
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"must be a power of two >= 16, got {value}")
        return value


@dataclass(slots=True)
class TritonAttentionState:
    """What :meth:`TritonAttention.prepare` builds once per step for every layer."""

    num_tokens: int
    slot_mapping: torch.Tensor  # [T] int64, -1 = write nowhere
    block_tables: torch.Tensor  # [B, max_blocks]
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_q: int  # query tokens per program of the unified kernel
    grid: tuple[int, int]  # the unified kernel's: (num_tokens // block_q + num_seqs, Hkv)
    num_splits: int  # > 1: split-KV decode instead of the unified kernel
    part_out: torch.Tensor | None = None  # [B, H, S, D] float32, split-KV partial outputs
    part_max: torch.Tensor | None = None  # [B, H, S] float32, their row maxima (base 2)
    part_sum: torch.Tensor | None = None  # [B, H, S] float32, their softmax sums


class TritonAttention(AttentionBackend):
    """Unified Triton attention over the paged cache, with split-KV decode; graph-capturable decode."""

    cuda_graphs = CudaGraphSupport.DECODE

    def __init__(self, spec: AttentionSpec, options: TritonOptions | None = None) -> None:
        super().__init__(spec, options or TritonOptions())
        try:
            from modserve.attention_backends import triton_kernels
        except ImportError as e:
            raise ValueError(f"attention backend triton needs the triton package, which cannot be imported ({e})") \
                from None
        self.kernels = triton_kernels
        device = spec.device.type
        if device == "cpu" and not triton_kernels.interpreted():
            raise ValueError("attention backend triton runs on a cpu device only under the Triton interpreter: "
                             "set TRITON_INTERPRET=1 before the process starts (slow; for tests)")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"attention backend triton runs on cuda devices (or cpu under the Triton "
                             f"interpreter), not {device}")
        if spec.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"attention backend triton computes in float32, float16 or bfloat16, not {spec.dtype}")
        self.group = spec.num_heads // spec.num_kv_heads
        self.fp8 = spec.kv_cache_dtype == FP8
        self.num_sms = torch.cuda.get_device_properties(spec.device).multi_processor_count \
            if device == "cuda" else 0
        # NOTE: float32 multiplies on CUDA cores (input_precision="ieee"), where a dot holds its
        # whole tile in registers: 64 x 64 tiles spill (ptxas), 16 x 32 do not.
        small = device == "cuda" and spec.dtype == torch.float32
        self.block_m = self.options.block_m or (16 if small else 64)
        self.tile_n = self.options.tile_n or (32 if small else 64)
        self.num_warps = 8 if spec.head_dim > 128 else 4  # head size 256: 4 warps spill at 64 x 64 tiles

    def kv_cache_problem(self) -> str | None:
        if self.spec.kv_cache_dtype in (self.spec.dtype, FP8):
            return None
        return f"triton reads a KV cache in the compute dtype or float8_e4m3fn, not {self.spec.kv_cache_dtype}"

    # -- once per step ---------------------------------------------------
    def prepare(self, meta: AttentionMetadata) -> TritonAttentionState:
        s = self.spec
        num_seqs = meta.query_start_loc.shape[0] - 1
        g_pad = _next_power_of_2(self.group)
        # Decodes (and short chunks) take as few rows as tl.dot allows; prefills block_m.
        block_q = min(_next_power_of_2(max(meta.max_query_len, 1)), max(1, self.block_m // g_pad))
        block_q = max(16, block_q * g_pad) // g_pad
        num_splits = self._num_splits(meta, num_seqs) if meta.max_query_len == 1 else 1
        state = TritonAttentionState(
            num_tokens=meta.num_tokens,
            slot_mapping=meta.slot_mapping,
            block_tables=meta.block_tables if meta.block_tables.stride(1) == 1 else meta.block_tables.contiguous(),
            query_start_loc=meta.query_start_loc.to(torch.int32),
            seq_lens=meta.seq_lens.to(torch.int32),
            block_q=block_q,
            grid=(meta.num_tokens // block_q + num_seqs, s.num_kv_heads),
            num_splits=num_splits,
        )
        if num_splits > 1:
            device = meta.query_start_loc.device
            state.part_out = torch.empty(num_seqs, s.num_heads, num_splits, s.head_dim, dtype=torch.float32,
                                         device=device)
            state.part_max = torch.empty(num_seqs, s.num_heads, num_splits, dtype=torch.float32, device=device)
            state.part_sum = torch.empty(num_seqs, s.num_heads, num_splits, dtype=torch.float32, device=device)
        return state

    def _num_splits(self, meta: AttentionMetadata, num_seqs: int) -> int:
        """Slices per decode: forced by the options, else enough programs to fill the GPU,
        each slice at least MIN_SPLIT_TILES tiles of ``max_seq_len`` (a bound, never a value)."""
        if self.options.decode_splits is not None:
            return self.options.decode_splits
        programs = num_seqs * self.spec.num_kv_heads
        if self.num_sms == 0 or programs == 0:
            return 1
        wanted = -(-PROGRAMS_PER_SM * self.num_sms // programs)
        longest = meta.max_seq_len // (MIN_SPLIT_TILES * self.tile_n)
        return max(1, min(wanted, longest, MAX_SPLITS))

    # -- once per layer --------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        state: TritonAttentionState | None,
    ) -> torch.Tensor:  # [T, H, D]
        if state is None:
            state = self.prepare(meta)
        self.write(k, v, kv_cache, state)
        return self.attend(q, kv_cache, state)

    def write(
        self,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        state: TritonAttentionState,
    ) -> None:
        """Store this step's k/v at ``state.slot_mapping`` (quantized for an fp8 cache)."""
        s = self.spec
        cache = kv_cache
        if self.fp8:  # the same bits as reference's write; the kernel copies bytes
            k, v = to_fp8(k, s.k_scale).view(torch.uint8), to_fp8(v, s.v_scale).view(torch.uint8)
            cache = kv_cache.view(torch.uint8)
        self.kernels.write_kv(cache[0], cache[1], _rows_contiguous(k), _rows_contiguous(v), state.slot_mapping)

    def attend(
        self,
        q: torch.Tensor,  # [T, H, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        state: TritonAttentionState,
    ) -> torch.Tensor:  # [T, H, D] in q's dtype
        """Attention of every query row over its sequence's cached keys (this step's written)."""
        s = self.spec
        q = _rows_contiguous(q)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if state.num_tokens == 0:
            return out
        cache = kv_cache.view(torch.uint8) if self.fp8 else kv_cache
        assert cache.stride(-1) == 1, "the KV cache's head dimension must be contiguous"
        # Read the scales now: the core may set them after __init__.
        qk_scale = s.scale * (s.k_scale if self.fp8 else 1.0) * self.kernels.LOG2E
        out_scale = s.v_scale if self.fp8 else 1.0
        common = dict(group=self.group, tile_n=self.tile_n, qk_scale=qk_scale, out_scale=out_scale,
                      fp8=self.fp8, num_warps=self.num_warps)
        if state.num_splits > 1:
            self.kernels.split_decode_attention(
                out, q, cache[0], cache[1], state.block_tables, state.query_start_loc, state.seq_lens,
                state.part_out, state.part_max, state.part_sum, **common)
        else:
            self.kernels.unified_attention(
                out, q, cache[0], cache[1], state.block_tables, state.query_start_loc, state.seq_lens,
                grid=state.grid, block_q=state.block_q, **common)
        return out


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, heads, D] with a contiguous last dimension (the kernels take the other strides)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
