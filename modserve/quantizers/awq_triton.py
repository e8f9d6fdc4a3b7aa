"""A fused dequantize-GEMM for AWQ weights on GPUs, in Triton.

``y = x @ W.T`` with ``W.T [K, N]`` read straight from the packed checkpoint tensors: each
program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``y``, walking K in steps of ``BLOCK_K``
(a divisor of the group size, so a step sees one row of zeros and scales). The 4-bit
weights are unpacked in registers and never written out.

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (read when this module is imported): that
is how the tests check it without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _awq_gemm_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, y_ptr,
    M, N, K, group_size,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows of x and y
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output channels
    rk = tl.arange(0, BLOCK_K)  # [BK]
    m_ok, n_ok = rm < M, rn < N
    # AWQ packs 8 channels per int32 in the order 0 2 4 6 1 3 5 7:
    # channel j sits in nibble (j % 8) // 2 + 4 * (j % 2), i.e. shifts 0 16 4 20 8 24 12 28.
    shift = ((rn % 8) // 2 + (rn % 2) * 4) * 4  # [BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * K + k[None, :], mask=m_ok[:, None], other=0.0)  # [BM, BK]
        packed = tl.load(qweight_ptr + k[:, None] * (N // 8) + rn[None, :] // 8,
                         mask=n_ok[None, :], other=0)  # [BK, BN], each int32 read for its 8 channels
        group = k0 // group_size
        zeros = tl.load(qzeros_ptr + group * (N // 8) + rn // 8, mask=n_ok, other=0)  # [BN]
        scales = tl.load(scales_ptr + group * N + rn, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
        q = (packed >> shift[None, :]) & 0xF  # [BK, BN]
        z = (zeros >> shift) & 0xF  # [BN]
        w = (q - z[None, :]).to(tl.float32) * scales[None, :]  # [BK, BN] = W.T tile
        acc += tl.dot(x, w.to(x_ptr.dtype.element_ty))  # fp16/bf16 tensor cores; fp32 inputs: tf32
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
             group_size: int) -> torch.Tensor:
    """``x [M, K]`` times the AWQ weight (``qweight [K, N/8]``, ``qzeros [K/g, N/8]``,
    ``scales [K/g, N]``) -> ``y [M, N]`` in ``x``'s dtype, accumulated in float32."""
    x = x.contiguous()
    m, k = x.shape
    n = scales.shape[1]
    block_m = min(64, max(16, triton.next_power_of_2(m)))  # decode: one 16-row tile
    block_n = 64 if n >= 64 else 32
    block_k = 32 if group_size % 32 == 0 else 16
    if group_size % block_k or k % block_k:
        raise ValueError(f"awq_gemm: group size {group_size} and K={k} must be multiples of 16")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _awq_gemm_kernel[grid](x, qweight, qzeros, scales, y, m, n, k, group_size,
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
