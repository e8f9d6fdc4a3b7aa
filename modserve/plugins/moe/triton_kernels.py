"""The Triton kernel of the ``triton`` MoE backend: one grouped GEMM over expert-sorted rows.

Imported only when that backend is made (it needs triton). ``triton.jit`` picks the
interpreter when the kernel is defined, i.e. at import: ``TRITON_INTERPRET=1`` must be set
before, and then the kernel runs on CPU tensors only. There bfloat16 is multiplied in float32
(``DOT_F32``): the interpreter keeps bfloat16 as uint16 and its ``tl.dot`` would multiply those
integers (Triton 3.7); on a GPU bfloat16 goes to the tensor cores as it is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr,
    N, K, num_assignments, a_rows_per_id,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    MUL_WEIGHTS: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (m, n): rows ``sorted_ids[m*BLOCK_M:+BLOCK_M]`` (assignments of one expert; the
    padding id ``num_assignments`` masked) times columns ``n*BLOCK_N:+BLOCK_N`` of that expert's
    ``B[e]`` ``[N, K]``. Row ``id`` reads ``A[id // a_rows_per_id]`` and writes ``C[id]``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # a block past the last expert's padded rows
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)  # [BM]
    row_ok = ids < num_assignments
    a_rows = ids // a_rows_per_id
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        b = tl.load(b_base + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BN]
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    if MUL_WEIGHTS:
        w = tl.load(weights_ptr + ids, mask=row_ok, other=0.0)  # [BM] float32
        acc = acc * w[:, None]
    tl.store(c_ptr + ids[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def moe_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, sorted_ids: torch.Tensor,
             block_expert: torch.Tensor, a_rows_per_id: int, weights: torch.Tensor | None,
             block_m: int, block_n: int, block_k: int) -> None:
    """``c[id] = (w[id] *) a[id // a_rows_per_id] @ b[e].T`` for every id of ``sorted_ids``
    (``[P]``, expert-sorted, padded per expert to ``block_m`` rows) in a block of expert e.

    a ``[rows, K]``, b ``[E, N, K]``, c ``[num_assignments, N]``, weights ``[num_assignments]``."""
    n, k = b.shape[1], b.shape[2]
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    # NOTE: float32 multiplies in full precision ("ieee"), not TF32: float32 results match reference.
    dot_f32 = a.dtype == torch.bfloat16 and interpreted()
    precision = "ieee" if a.dtype == torch.float32 or dot_f32 else None
    _moe_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, sorted_ids, block_expert,
        n, k, c.shape[0], a_rows_per_id,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        MUL_WEIGHTS=weights is not None, PRECISION=precision, DOT_F32=dot_f32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def interpreted() -> bool:
    """Whether the kernel was defined under the interpreter (runs on CPU tensors only)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_moe_gemm_kernel, InterpretedFunction)
