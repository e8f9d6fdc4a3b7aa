"""The paged attention backend: the fast path for CPU, in plain torch ops.

Cache layout (per layer): ``[2 (k, v), num_blocks, Hkv, block_size, D]``, head-major
inside a block. A block's keys for one KV head are then one contiguous
``bs * D`` row, so one ``index_select`` over rows ``block * Hkv + h`` gathers a
sequence's keys already as ``[Hkv, L, D]``: the layout attention wants, with no
transposed copies. (Dimension 1 is still the block index, as block copies and
swaps require.)

A step's batch splits into two groups:

- decodes (one new token each): on a CPU in float32 (over a float32 or bf16 cache), one
  call of a C++ kernel
  (``csrc/paged_decode.cpp``, built on first use by :func:`modserve.api.load_kernel`)
  that reads each sequence's blocks in
  place, one task per (sequence, KV head), in 16-float vectors where it was built with
  AVX-512 (:func:`kernel_width`), else 8. Elsewhere, or
  where the kernel cannot be built, they are sorted by length into groups of up to 16,
  run as one batched computation per group: their KV is gathered into ``[Bd, Hkv, L, D]``
  (``L`` = the group's longest decode, rounded up to whole blocks) and attended
  with two plain batched matmuls, queries viewed as
  ``[Bd, Hkv, G, D]`` (``G = H / Hkv`` query heads share one KV head, so KV is
  never repeated), keys ``j >= seq_len`` masked out and softmax in float32. For a
  single query row this beats SDPA on CPU by about 2x: the fused kernel is built
  for long queries, and with strided ``[Bd * L, Hkv, D]`` keys it did more work;
- prefills (several new tokens) run one SDPA call per sequence: straight on the
  new k/v with ``is_causal`` when nothing is cached yet, else on KV gathered from
  the cache with a causal mask offset by the context length. Over a bf16 cache under
  float32 compute they attend in bf16 where the CPU has AVX512-BF16
  (``PagedOptions.bf16_prefill``): torch's flash kernel multiplies bf16 there at about
  twice its float32 speed, and the new tokens' keys and values are those the cache holds.

Everything index-like (the rows this step's k/v are written to, the gather
indices, the masks) is built once per step in :meth:`PagedAttention.prepare`
and shared by all layers. Gathers go into workspace buffers that the backend
keeps and reuses across layers and steps, since touching freshly allocated
memory costs more than the copy itself on CPU.

SDPA is always called with 4-D ``[B, H, L, D]`` inputs: on CPU only those reach
the fused flash kernel (3-D inputs fall back to the math path, which repeats KV
heads). Decodes in bfloat16/float16 are computed in float32 (KV converted after it
is gathered), on every device: on CPU because PyTorch's reduced-precision matmuls are
several times slower there unless the CPU has native bf16 support.

A bf16 cache under float32 compute (the CPU's ``bf16_gemm`` route) stores each key and
value rounded to bf16 and is read widened to float32: half the bytes a decode reads.

An fp8 (e4m3) cache holds ``k / k_scale`` and ``v / v_scale``. Attention reads it
unscaled, in float32, with ``k_scale`` folded into the softmax scale and ``v_scale``
into the output: ``softmax(q (ks k8)^T s) (vs v8) = vs softmax(q k8^T (ks s)) v8``.
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field

from modserve.attention_backends import DECODE_KERNEL
from modserve.api.cpp import load_kernel
from modserve.api.fp8 import FP8, fp8_to_float, to_fp8
from modserve.api import AttentionBackend, AttentionMetadata, AttentionSpec

logger = logging.getLogger("modserve")


FEW_WRITE_ROWS = 128  # up to this many, a step's write rows are made in Python, not numpy


def write_rows(slots: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:  # [T] -> [T * Hkv]
    """The cache rows (a half viewed ``[num_blocks * Hkv * bs, D]``) each new token's k or v goes
    to, ordered (t, h) as ``k.reshape(T * Hkv, D)``. In numpy for a CPU tensor: a step's handful
    of tiny ops costs a few microseconds there against tens in torch's dispatch, and a few
    decodes' rows in a Python list fewer still."""
    if slots.device.type == "cpu" and not torch.compiler.is_compiling():
        if slots.shape[0] * num_kv_heads <= FEW_WRITE_ROWS:
            few = [(x // block_size * num_kv_heads + h) * block_size + x % block_size
                   for x in slots.tolist() for h in range(num_kv_heads)]
            return torch.from_numpy(np.array(few, dtype=np.int64))
        s = slots.numpy()  # [T]
        rows = ((s // block_size * num_kv_heads)[:, None] + np.arange(num_kv_heads)) * block_size \
            + (s % block_size)[:, None]  # [T, Hkv]
        return torch.from_numpy(rows.reshape(-1))
    heads = torch.arange(num_kv_heads, device=slots.device)  # [Hkv]
    rows = ((slots // block_size * num_kv_heads)[:, None] + heads) * block_size + (slots % block_size)[:, None]
    return rows.reshape(-1)


@functools.cache
def head_ids(num_kv_heads: int, device: torch.device) -> torch.Tensor:  # [Hkv]
    """``arange(Hkv)``, made once per device: nothing writes it."""
    with torch.inference_mode(False):
        return torch.arange(num_kv_heads, device=device)


class PagedOptions(BaseModel):
    cpu_kernel: bool = Field(True, description="Decode with the C++ kernel on a CPU in float32 (false: torch ops)")
    bf16_prefill: Literal["auto", "on", "off"] = Field(
        "auto", description="Prefills over a bf16 cache under float32 compute attend in bf16 (bf16 products, "
                            "float32 sums; the keys and values as the cache holds them): auto where the CPU has "
                            "AVX512-BF16, whose SDPA multiplies bf16 natively")


@dataclass(slots=True)
class PrefillPlan:
    """One prefill sequence: its query rows and, with a cached context, where its KV lives."""

    start: int  # first query row
    end: int  # one past the last query row
    seq_len: int
    # [Hkv * nb] rows (block * Hkv + h) of a cache half viewed [num_blocks * Hkv, bs * D],
    # ordered (h, block): gathered, they form [Hkv, nb * bs, D]. None if context_len == 0
    kv_rows: torch.Tensor | None
    mask: torch.Tensor | None  # [Lq, seq_len] bool, True = attend; None if context_len == 0


@dataclass(slots=True)
class DecodeGroup:
    """Decodes attended together, their KV padded to the longest of them."""

    rows: torch.Tensor  # [Bg] query row of each decode
    # [Bg * Hkv * nb] rows (block * Hkv + h) of a cache half viewed [num_blocks * Hkv, bs * D],
    # ordered (decode, h, block): gathered, they form [Bg, Hkv, L, D]
    kv_rows: torch.Tensor
    bias: torch.Tensor  # [Bg * Hkv, 1, L] float32: 0 where key j < seq_len, else -inf
    in_order: bool  # rows are 0..Bg-1: the step is this group alone, no scatter needed


@dataclass(slots=True)
class KernelDecodes:
    """The step's decodes, for the C++ kernel: their rows, block tables and lengths."""

    rows: torch.Tensor | None  # [Bd] query row of each decode; None: rows 0..Bd-1 are all the step's
    block_tables: torch.Tensor  # [Bd, max_blocks] int64
    seq_lens: torch.Tensor  # [Bd] int64


@dataclass(slots=True)
class PagedAttentionState:
    """What :meth:`PagedAttention.prepare` builds once per step for every layer."""

    # [T * Hkv] row of each (new token, KV head) in a cache half viewed [slots * Hkv, D]:
    # (block * Hkv + h) * block_size + offset
    write_rows: torch.Tensor | None = None
    num_decodes: int = 0
    all_decodes: bool = False  # every row is a decode
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    kernel_decodes: KernelDecodes | None = None
    prefills: list[PrefillPlan] = field(default_factory=list)



# Decodes are sorted by length and attended in groups of this many, each padded to its
# own longest: on the reference workload, padding every decode to the step's longest
# gathered and multiplied 2.4x the keys there are; groups of 16 cut that to 1.36x.
DECODE_GROUP = 16


@functools.cache
def kernel_width(head_dim: int) -> int:
    """Floats per vector of the decode kernel on this head size: 16 where it was built with
    AVX-512 (``-march=native``: where this CPU has it) and ``head_dim`` is a multiple of 16,
    else 8. Logged once per head size, as the CPU platform logs its linear route."""
    widest = torch.ops.modserve_paged.vector_width()
    width = 16 if widest == 16 and head_dim % 16 == 0 else 8
    why = ("AVX-512" if width == 16 else f"head_dim {head_dim} is not a multiple of 16" if widest == 16
           else "no AVX-512")
    logger.info("paged decode kernel: %d-float vectors (%s)", width, why)
    return width


class PagedAttention(AttentionBackend):
    """Batched decode attention plus per-sequence SDPA prefills over a paged KV cache."""

    def __init__(self, spec: AttentionSpec, options: PagedOptions | None = None) -> None:
        super().__init__(spec, options or PagedOptions())
        self._workspace: dict[str, torch.Tensor] = {}
        self.fp8 = spec.kv_cache_dtype == FP8
        # (softmax scale, factor on the output): the fp8 cache's scales folded in
        self._scales = (spec.scale * spec.k_scale, spec.v_scale) if self.fp8 else (spec.scale, 1.0)
        self.kernel = (self.options.cpu_kernel and spec.device.type == "cpu" and spec.dtype == torch.float32
                       and spec.kv_cache_dtype in (torch.float32, torch.bfloat16) and spec.head_dim % 8 == 0
                       and load_kernel("modserve_paged_decode", str(DECODE_KERNEL)) is None)
        self.kernel_width = kernel_width(spec.head_dim) if self.kernel else None
        bf16_cache = spec.kv_cache_dtype == torch.bfloat16 and spec.dtype == torch.float32
        self.bf16_prefill = bf16_cache and (self.options.bf16_prefill == "on" or (
            self.options.bf16_prefill == "auto" and spec.device.type == "cpu" and torch.cpu._is_avx512_bf16_supported()))

    def kv_cache_problem(self) -> str | None:
        s = self.spec
        if s.kv_cache_dtype in (s.dtype, FP8) or (s.kv_cache_dtype == torch.bfloat16 and s.dtype == torch.float32):
            return None
        return (f"paged reads a KV cache in the compute dtype, float8_e4m3fn, or bfloat16 under float32 "
                f"compute, not {s.kv_cache_dtype} under {s.dtype}")

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """``[2, num_blocks, Hkv, block_size, D]``: head-major blocks (see the module docstring)."""
        s = self.spec
        return (2, num_blocks, s.num_kv_heads, s.block_size, s.head_dim)

    def native_decode(self) -> str | None:
        """The C++ kernel's path as one op (write k, v, then decode), where it runs."""
        return "modserve_paged::decode_step" if self.kernel else None

    # -- once per step ---------------------------------------------------
    def prepare(self, meta: AttentionMetadata) -> PagedAttentionState:
        bs, hkv = self.spec.block_size, self.spec.num_kv_heads
        device = meta.block_tables.device
        state = PagedAttentionState()
        heads = head_ids(hkv, device)  # [Hkv]
        state.write_rows = write_rows(meta.slot_mapping, bs, hkv)

        decode_seqs = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        state.num_decodes = len(decode_seqs)
        state.all_decodes = bool(decode_seqs) and len(decode_seqs) == meta.num_seqs
        if self.kernel and decode_seqs:
            state.kernel_decodes = self._kernel_decodes(meta, decode_seqs)
        else:
            if len(decode_seqs) > DECODE_GROUP:
                decode_seqs.sort(key=lambda i: meta.seq_lens_cpu[i])
            for g in range(0, len(decode_seqs), DECODE_GROUP):
                state.decode_groups.append(self._decode_group(meta, decode_seqs[g : g + DECODE_GROUP], heads))

        starts = itertools.accumulate(meta.query_lens_cpu, initial=0)  # on the host: no device sync
        for i, (start, query_len) in enumerate(zip(starts, meta.query_lens_cpu)):
            if query_len <= 1:  # decodes above; an empty sequence has nothing to do
                continue
            context_len, seq_len = meta.context_lens_cpu[i], meta.seq_lens_cpu[i]
            if context_len == 0:
                state.prefills.append(PrefillPlan(start, start + query_len, seq_len, None, None))
                continue
            blocks = meta.block_tables[i, : -(-seq_len // bs)]  # [nb]
            kv_rows = (blocks * hkv + heads[:, None]).reshape(-1)  # [Hkv * nb], ordered (h, block)
            key_pos = torch.arange(seq_len, device=device)  # [L]
            query_pos = torch.arange(context_len, seq_len, device=device)  # [Lq]
            mask = key_pos[None, :] <= query_pos[:, None]  # [Lq, L]
            state.prefills.append(PrefillPlan(start, start + query_len, seq_len, kv_rows, mask))
        return state

    @staticmethod
    def _kernel_decodes(meta: AttentionMetadata, seqs: list[int]) -> KernelDecodes:
        if seqs == list(range(meta.num_seqs)):  # the whole step, in order: no gather, no scatter
            return KernelDecodes(None, meta.block_tables, meta.seq_lens)
        idx = torch.tensor(seqs, dtype=torch.long, device=meta.block_tables.device)
        return KernelDecodes(meta.query_start_loc[idx], meta.block_tables[idx], meta.seq_lens[idx])

    def _decode_group(self, meta: AttentionMetadata, seqs: list[int], heads: torch.Tensor) -> DecodeGroup:
        bs, device = self.spec.block_size, meta.block_tables.device
        num_blocks = -(-max(meta.seq_lens_cpu[i] for i in seqs) // bs)
        in_order = seqs == list(range(meta.num_seqs))
        if in_order:
            tables, seq_lens, rows = meta.block_tables, meta.seq_lens, meta.query_start_loc[:-1]
        else:
            idx = torch.tensor(seqs, dtype=torch.long, device=device)  # [Bg]
            tables, seq_lens, rows = meta.block_tables[idx], meta.seq_lens[idx], meta.query_start_loc[idx]
        kv_rows = tables[:, None, :num_blocks] * self.spec.num_kv_heads + heads[:, None]  # [Bg, Hkv, nb]
        key_pos = torch.arange(num_blocks * bs, device=device)  # [L]
        bias = torch.zeros(len(seqs), num_blocks * bs, dtype=torch.float32, device=device)
        bias.masked_fill_(key_pos >= seq_lens[:, None], float("-inf"))
        bias = bias.repeat_interleave(self.spec.num_kv_heads, dim=0)[:, None, :]  # one row per (decode, KV head)
        return DecodeGroup(rows, kv_rows.reshape(-1), bias, in_order)

    # -- once per layer --------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, Hkv, block_size, D]
        meta: AttentionMetadata,
        state: PagedAttentionState | None,
    ) -> torch.Tensor:  # [T, H, D]
        if state is None:
            state = self.prepare(meta)
        s = self.spec
        d = s.head_dim
        assert state.write_rows is not None
        key_cache, value_cache = kv_cache[0].view(-1, d), kv_cache[1].view(-1, d)  # [slots * Hkv, D]
        if self.fp8:
            self._scales = (s.scale * s.k_scale, s.v_scale)  # the core may set scales after __init__
            k, v = to_fp8(k, s.k_scale), to_fp8(v, s.v_scale)
            # as raw bytes: index_copy_ has no float8 kernel on CPU
            key_cache.view(torch.uint8).index_copy_(0, state.write_rows, k.view(torch.uint8).reshape(-1, d))
            value_cache.view(torch.uint8).index_copy_(0, state.write_rows, v.view(torch.uint8).reshape(-1, d))
        else:  # [T * Hkv, D], rows (t, h), rounded to a bf16 cache's dtype where it is one
            key_cache.index_copy_(0, state.write_rows, k.reshape(-1, d).to(key_cache.dtype))
            value_cache.index_copy_(0, state.write_rows, v.reshape(-1, d).to(value_cache.dtype))

        kd = state.kernel_decodes
        if kd is not None and kd.rows is None:
            return torch.ops.modserve_paged.decode(q, kv_cache[0], kv_cache[1], kd.block_tables, kd.seq_lens, s.scale)
        groups = state.decode_groups
        if len(groups) == 1 and groups[0].in_order:
            return self._decode(q, kv_cache, groups[0])
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
        if kd is not None:
            q_dec = q.index_select(0, kd.rows)  # [Bd, H, D]
            out.index_copy_(0, kd.rows, torch.ops.modserve_paged.decode(q_dec, kv_cache[0], kv_cache[1],
                                                                        kd.block_tables, kd.seq_lens, s.scale))
        for g in groups:
            q_dec = q.index_select(0, g.rows)  # [Bg, H, D]
            out.index_copy_(0, g.rows, self._decode(q_dec, kv_cache, g))
        for p in state.prefills:
            q_p = q[p.start : p.end].transpose(0, 1)[None]  # [1, H, Lq, D]
            if p.kv_rows is None:  # only the new tokens: [1, Hkv, Lq, D]
                keys, values = k[p.start : p.end].transpose(0, 1)[None], v[p.start : p.end].transpose(0, 1)[None]
            else:  # [1, Hkv, nb * bs, D]
                keys = self._gather("k", kv_cache[0], p.kv_rows).view(1, s.num_kv_heads, -1, d)
                values = self._gather("v", kv_cache[1], p.kv_rows).view(1, s.num_kv_heads, -1, d)
            if self.fp8:
                keys, values, q_p = self._float("k", keys), self._float("v", values), q_p.float()
            elif self.bf16_prefill:  # new tokens' KV rounded as the cache stores it
                keys, values, q_p = keys.bfloat16(), values.bfloat16(), q_p.bfloat16()
            elif keys.dtype != q_p.dtype:  # a bf16 cache under float32 compute
                keys, values = keys.to(q_p.dtype), values.to(q_p.dtype)
            if p.kv_rows is not None:
                keys, values = keys[:, :, : p.seq_len], values[:, :, : p.seq_len]  # [1, Hkv, L, D]
            o = F.scaled_dot_product_attention(
                q_p,
                keys,
                values,
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=self._scales[0],
                enable_gqa=True,
            )  # [1, H, Lq, D]
            if self.fp8:
                o = o * self._scales[1]
            out[p.start : p.end] = o[0].transpose(0, 1)  # widened from bf16 where it attended in bf16
        return out

    def _decode(
        self,
        q: torch.Tensor,  # [Bd, H, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, Hkv, block_size, D]
        group: DecodeGroup,
    ) -> torch.Tensor:  # [Bd, H, D]
        s = self.spec
        bd, hkv = q.shape[0], s.num_kv_heads
        keys = self._gather("k", kv_cache[0], group.kv_rows).view(bd, hkv, -1, s.head_dim)  # [Bd, Hkv, L, D]
        values = self._gather("v", kv_cache[1], group.kv_rows).view(bd, hkv, -1, s.head_dim)
        dtype = q.dtype
        if self.fp8:
            keys, values = self._float("k", keys), self._float("v", values)
        elif keys.dtype in (torch.bfloat16, torch.float16):
            keys = self._buffer("k32", keys.shape, torch.float32, keys.device).copy_(keys)
            values = self._buffer("v32", values.shape, torch.float32, values.device).copy_(values)
        # Everything in float32 from here. Query head h reads KV head h // G (as HF's
        # repeat_kv): queries [Bd * Hkv, G, D] against keys [Bd * Hkv, L, D].
        n, length = bd * hkv, keys.shape[2]
        q = q.to(torch.float32).reshape(n, -1, s.head_dim)
        # scale * q k^T + bias (-inf past each sequence's end) in one call: [Bd * Hkv, G, L]
        scores = torch.baddbmm(group.bias, q, keys.view(n, length, s.head_dim).transpose(1, 2),
                               alpha=self._scales[0])
        o = torch.bmm(torch.softmax(scores, dim=-1), values.view(n, length, s.head_dim))  # [Bd * Hkv, G, D]
        if self.fp8:
            o *= self._scales[1]
        return o.view(bd, -1, s.head_dim).to(dtype)  # [Bd, H, D]

    def _float(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """fp8 keys or values -> float32 (unscaled) in workspace ``name``32."""
        return fp8_to_float(x, out=self._buffer(name + "32", x.shape, torch.float32, x.device),
                            index=self._buffer(name + "idx", x.shape, torch.int32, x.device))

    # -- workspace -------------------------------------------------------
    def _gather(self, name: str, cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Copy (block, KV head) rows of one cache half (``[num_blocks, Hkv, bs, D]``,
        viewed ``[num_blocks * Hkv, bs * D]``) in the order of ``rows`` into workspace
        ``name``: ``[len(rows), bs * D]``."""
        flat = cache.view(-1, cache.shape[2] * cache.shape[3])
        out = self._buffer(name, (rows.numel(), flat.shape[1]), cache.dtype, cache.device)
        return torch.index_select(flat, 0, rows, out=out)

    def _buffer(self, name: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        """A reusable, grow-only scratch tensor (its contents are garbage)."""
        numel = _numel(shape)
        buf = self._workspace.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            if buf is not None and buf.dtype == dtype and buf.device == device:
                numel = max(numel, buf.numel() * 3 // 2)  # sequences grow: leave headroom
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._workspace[name] = buf
        return buf[: _numel(shape)].view(shape)


def _numel(shape: tuple[int, ...] | torch.Size) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
