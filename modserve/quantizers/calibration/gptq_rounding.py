"""GPTQ: quantize a linear's weight one input column at a time, each column's rounding error
spread over the columns not yet quantized through the inverse Hessian of its inputs.

For ``y = x @ W.T`` over calibration inputs ``X [T, K]``, ``H = 2 X^T X / T`` is the Hessian of
the output error ``|X (W - Q)^T|^2`` in the weights. Quantizing column ``j`` to ``q_j`` costs
``(w_j - q_j)^2 / [H^-1]_jj`` and is best compensated by moving the later columns by
``-(w_j - q_j) / [H^-1]_jj * [H^-1]_j,>j`` (the Optimal Brain Surgeon update). The inverse is
taken once, as the upper Cholesky factor of ``H^-1``, whose rows are exactly the updates of this
column order; columns go in blocks of 128, with the update to later blocks applied once per block.

The grid is GPTQ's symmetric one (``sym``: zero ``2**(bits-1)``, scale ``2 max|w| / (2**bits - 1)``
per group and output channel), each group's scale taken from the weights as they stand when
the group's first column is reached (``static_groups`` off), rounded to float16 as stored. With
``act_order`` (``desc_act``) columns go in order of decreasing ``H_jj`` (the inputs that matter
most first) and ``g_idx`` says which group each input channel landed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class GPTQResult:
    q: torch.Tensor  # [K, N] int32, input order
    zeros: torch.Tensor  # [groups, N] int32
    scales: torch.Tensor  # [groups, N] float16
    g_idx: torch.Tensor  # [K] int32

    def dequantized(self) -> torch.Tensor:  # [N, K] float32
        idx = self.g_idx.long()
        return ((self.q - self.zeros[idx]) * self.scales.float()[idx]).t()


def _group_grid(w: torch.Tensor, maxq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, g]`` -> (scale [N] as float16 stores it, zero [N])."""
    scale = (2 * w.abs().amax(dim=1).clamp(min=1e-5) / maxq).half().float()
    return scale, torch.full_like(scale, (maxq + 1) // 2)


def gptq_quantize_weight(w: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int,
                         damp_percent: float = 0.01, act_order: bool = False, block: int = 128) -> GPTQResult:
    """``w [N, K]``, ``hessian [K, K]`` (any positive multiple of ``X^T X``) -> the quantized weight."""
    W = w.detach().double().clone()  # [N, K]
    H = hessian.double().clone()
    n, k = W.shape
    maxq = 2**bits - 1
    g = k if group_size == -1 else group_size
    dead = torch.diag(H) == 0  # an input that is always zero: its weights do not matter
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp_percent * torch.mean(torch.diag(H)) * torch.eye(k, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)  # [K, K]

    Q = torch.zeros(n, k, dtype=torch.int32)
    groups = (k + g - 1) // g
    scales, zeros = torch.zeros(groups, n), torch.zeros(groups, n)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1, Err1 = W[:, i1:i2].clone(), torch.zeros(n, i2 - i1, dtype=W.dtype)
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:  # a group starts: its grid from the weights as they are now
                ahead = torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, :g]
                scales[col // g], zeros[col // g] = _group_grid(ahead.float(), maxq)
            s, z = scales[col // g].double(), zeros[col // g].double()
            wcol = W1[:, i]
            q = torch.clamp(torch.round(wcol / s) + z, 0, maxq)
            Q[:, col] = q.int()
            err = (wcol - (q - z) * s) / Hinv[col, col]
            W1[:, i:] -= err[:, None] * Hinv[col, i1 + i:i2][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    inverse = torch.argsort(perm)
    g_idx = (torch.arange(k) // g).int()[inverse]  # channel perm[j] went j-th, into group j // g
    return GPTQResult(Q[:, inverse].t().contiguous(), zeros.int(), scales.half(), g_idx)


def gptq_round_to_nearest(w: torch.Tensor, bits: int, group_size: int) -> GPTQResult:
    """The same grid, each weight rounded on its own (what GPTQ is measured against)."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    maxq = 2**bits - 1
    grids = [_group_grid(w[:, i:i + g].float(), maxq) for i in range(0, k, g)]
    scales, zeros = torch.stack([s for s, _ in grids]), torch.stack([z for _, z in grids])  # [groups, N]
    g_idx = (torch.arange(k) // g).int()
    s, z = scales[g_idx.long()], zeros[g_idx.long()]  # [K, N]
    q = torch.clamp(torch.round(w.float().t() / s) + z, 0, maxq)
    return GPTQResult(q.int(), zeros.int(), scales.half(), g_idx)
