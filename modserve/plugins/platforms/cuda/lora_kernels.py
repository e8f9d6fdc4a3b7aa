"""The Triton kernels of the cuda platform's LoRA kernel (:mod:`.lora_triton`): Punica's shrink
and expand over adapter-sorted rows.

Rows come grouped by adapter: ``rows`` ``[N]`` int32 holds each group's batch rows back to
back, group ``g`` at ``rows[starts[g]:starts[g + 1]]``, using slot ``slots[g]`` (rows of no
adapter are in no group: nothing reads or writes them). One launch covers up to three output
slices (a fused q|k|v) of every group: grid ``(row tiles x column tiles, slices, groups)``;
a program whose row tile starts past its group's rows, or whose column tile starts past its
slice's columns, returns at once.

- ``_shrink_kernel``: ``h[s, t, :] = x[t] @ a_s[slot].T`` in float32, ``h`` ``[S, T, R]``.
- ``_expand_kernel``: ``y[t, start_s:+out_s] += (h[s, t] @ b_s[slot].T) * scaling[g]``, the
  float32 ``h`` first rounded to the weights' dtype as the reference's shrink output is; the
  sum is taken in float32 and rounded once into ``y``'s dtype.

Each row is in one group, so every element of ``y`` has one writer: no atomics. Slices come as
three pointer arguments (the unused ones repeat the first), picked by the program's slice index.

Everything here is ordinary GPU Triton. On CPU tensors it runs only under the interpreter,
chosen by ``triton.jit`` when this module is imported with ``TRITON_INTERPRET=1``; there
half-precision operands are multiplied in float32 (``DOT_F32``: the interpreter's ``tl.dot``
cannot multiply bfloat16) after the same roundings, so the tests check the loads, conversions
and stores of those dtypes, not their dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SLICES = 3  # slices per launch: q|k|v; more take further launches


@triton.jit
def _pick(s, v0, v1, v2):
    """Pointer ``v_s`` for the program's slice ``s`` (0, 1 or 2)."""
    if s == 0:
        v = v0
    elif s == 1:
        v = v1
    else:
        v = v2
    return v


@triton.jit
def _pick_int(s, v0, v1, v2):
    """Integer ``v_s``, selected without branches."""
    return tl.where(s == 0, v0, tl.where(s == 1, v1, v2))


@triton.jit
def _group_rows(rows_ptr, starts_ptr, g, tile_m, BLOCK_M: tl.constexpr):
    """This program's batch rows ``[BLOCK_M]`` (int64), which of them are real, and whether the
    tile starts past the group's end (no row at all)."""
    first = tl.load(starts_ptr + g) + tile_m * BLOCK_M
    end = tl.load(starts_ptr + g + 1)
    offs = first + tl.arange(0, BLOCK_M)  # [BM] into rows
    ok = offs < end
    rows = tl.load(rows_ptr + offs, mask=ok, other=0).to(tl.int64)
    return rows, ok, first >= end


@triton.jit
def _shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, h_ptr, rows_ptr, starts_ptr, slots_ptr,
    K, R,  # in features, max rank
    stride_xt, stride_xk,  # x [T, K]
    stride_al, stride_ar, stride_ak,  # every a_s [max_loras, R, K]
    stride_hs, stride_ht, stride_hr,  # h [S, T, R] float32
    TILES_R: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    g = tl.program_id(2)
    tile_m, tile_r = pid // TILES_R, pid % TILES_R
    rows, row_ok, past_end = _group_rows(rows_ptr, starts_ptr, g, tile_m, BLOCK_M)
    if past_end:
        return
    slot = tl.load(slots_ptr + g).to(tl.int64)
    a_ptr = _pick(s, a0_ptr, a1_ptr, a2_ptr) + slot * stride_al
    offs_r = tile_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    r_ok = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        a = tl.load(a_ptr + offs_k[:, None] * stride_ak + offs_r[None, :] * stride_ar,
                    mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # [BK, BR]: A^T's tile
        if DOT_F32:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=PRECISION)
    tl.store(h_ptr + s * stride_hs + rows[:, None] * stride_ht + offs_r[None, :] * stride_hr, acc,
             mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    h_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, rows_ptr, starts_ptr, slots_ptr, scaling_ptr,
    R,  # max rank
    start0, start1, start2,  # each slice's first column of y
    out0, out1, out2,  # each slice's columns
    stride_bl0, stride_bl1, stride_bl2,  # b_s [max_loras, out_s, R]: its slot stride
    stride_bn, stride_br,  # the same in every b_s
    stride_hs, stride_ht, stride_hr,  # h [S, T, R] float32
    stride_yt, stride_yn,  # y [T, sum(out_s)]
    TILES_N: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    g = tl.program_id(2)
    tile_m, tile_n = pid // TILES_N, pid % TILES_N
    out = _pick_int(s, out0, out1, out2)
    rows, row_ok, past_end = _group_rows(rows_ptr, starts_ptr, g, tile_m, BLOCK_M)
    if past_end | (tile_n * BLOCK_N >= out):
        return
    slot = tl.load(slots_ptr + g).to(tl.int64)
    b_ptr = _pick(s, b0_ptr, b1_ptr, b2_ptr) + slot * _pick_int(s, stride_bl0, stride_bl1, stride_bl2)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] columns of this slice
    n_ok = offs_n < out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, R, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK] rank
        k_ok = offs_k < R
        h = tl.load(h_ptr + s * stride_hs + rows[:, None] * stride_ht + offs_k[None, :] * stride_hr,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK] float32
        h = h.to(b_ptr.dtype.element_ty)  # the reference's shrink output is in the weights' dtype
        b = tl.load(b_ptr + offs_k[:, None] * stride_br + offs_n[None, :] * stride_bn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]: B^T's tile
        if DOT_F32:
            h = h.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(h, b, input_precision=PRECISION)
    acc = acc * tl.load(scaling_ptr + g)
    mask = row_ok[:, None] & n_ok[None, :]
    y_at = y_ptr + rows[:, None] * stride_yt + (_pick_int(s, start0, start1, start2) + offs_n)[None, :] * stride_yn
    y = tl.load(y_at, mask=mask, other=0.0)
    tl.store(y_at, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _block(n: int, cap: int) -> int:
    """A power of two >= 16 (``tl.dot``'s least) covering ``n``, at most ``cap``."""
    return max(16, min(triton.next_power_of_2(n), cap))


def _precision(dtype: torch.dtype) -> tuple[str | None, bool]:
    """(input_precision, DOT_F32): float32 multiplies in full precision ("ieee", not TF32), so it
    matches the reference; under the interpreter half precision goes through float32."""
    dot_f32 = dtype != torch.float32 and interpreted()
    return ("ieee" if dtype == torch.float32 or dot_f32 else None), dot_f32


def shrink(x: torch.Tensor, a: list[torch.Tensor], h: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
           slots: torch.Tensor, max_group_rows: int, block_m: int) -> None:
    """``h[s, rows_g] = x[rows_g] @ a[s][slots[g]].T`` for each group g and slice s (up to 3):
    x ``[T, K]``, a[s] ``[max_loras, R, K]`` alike, h ``[S, T, R]`` float32."""
    k, r = x.shape[1], a[0].shape[1]
    block_r, block_k = _block(r, 64), _block(k, 64)
    tiles_r = triton.cdiv(r, block_r)
    precision, dot_f32 = _precision(x.dtype)
    a0, a1, a2 = (a + [a[0]] * MAX_SLICES)[:MAX_SLICES]
    grid = (triton.cdiv(max_group_rows, block_m) * tiles_r, len(a), slots.numel())
    _shrink_kernel[grid](
        x, a0, a1, a2, h, rows, starts, slots, k, r,
        x.stride(0), x.stride(1), a0.stride(0), a0.stride(1), a0.stride(2), h.stride(0), h.stride(1), h.stride(2),
        TILES_R=tiles_r, PRECISION=precision, DOT_F32=dot_f32, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
    )


def expand(h: torch.Tensor, b: list[torch.Tensor], y: torch.Tensor, column_starts: list[int], rows: torch.Tensor,
           starts: torch.Tensor, slots: torch.Tensor, scaling: torch.Tensor, max_group_rows: int,
           block_m: int) -> None:
    """``y[rows_g, start_s:+out_s] += (h[s, rows_g] @ b[s][slots[g]].T) * scaling[g]`` for each
    group g and slice s (up to 3): h ``[S, T, R]`` float32, b[s] ``[max_loras, out_s, R]``."""
    r = h.shape[2]
    outs = [t.shape[1] for t in b]
    block_n, block_k = _block(max(outs), 64), _block(r, 64)
    tiles_n = triton.cdiv(max(outs), block_n)
    precision, dot_f32 = _precision(y.dtype)
    pad = MAX_SLICES - len(b)
    b0, b1, b2 = b + [b[0]] * pad
    grid = (triton.cdiv(max_group_rows, block_m) * tiles_n, len(b), slots.numel())
    _expand_kernel[grid](
        h, b0, b1, b2, y, rows, starts, slots, scaling, r,
        *(column_starts + [0] * pad), *(outs + [0] * pad), *([t.stride(0) for t in b] + [0] * pad),
        b0.stride(1), b0.stride(2), h.stride(0), h.stride(1), h.stride(2), y.stride(0), y.stride(1),
        TILES_N=tiles_n, PRECISION=precision, DOT_F32=dot_f32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def interpreted() -> bool:
    """Whether the kernels were defined under the interpreter (run on CPU tensors only)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_shrink_kernel, InterpretedFunction)
