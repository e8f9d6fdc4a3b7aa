"""AWQ: protect the weights that meet large activations by scaling them up before rounding.

For linears that read the same input ``X [T, K]`` (q/k/v after the attention norm, gate/up after
the MLP norm, down after up), a per-input-channel scale ``s`` is searched: the linears become
``W diag(s)`` and the op before them divides its output channels by ``s`` (an RMSNorm's weight,
or up_proj's rows), so the float model is unchanged, but rounding ``W diag(s)`` to 4 bits loses
less where ``s`` is large. ``s = mean|x|^alpha`` (normalized so that ``max s * min s = 1``), with
``alpha`` on a grid of 20 in [0, 1), the one whose quantized outputs ``(X / s) Q(W s)^T`` are
closest (mean squared error, summed over the group's linears) to ``X W^T``. The loss is taken on
the linears' own outputs, not through attention's softmax. o_proj is scaled through v_proj only
when their shapes allow it (no grouped-query attention), as in AutoAWQ.

Then the clip search: per output channel and group of ``g`` inputs, the weights are clipped
to ``ratio * max|w|`` for ratios 1.0 down to 0.5, keeping the ratio whose quantized group
outputs on a sample of ``X`` are closest (q and k are skipped: their errors pass through the
softmax, which this loss does not see). Rounding is AWQ's zero-point grid (``awq_quantize``).
"""

from __future__ import annotations

import torch

from modserve.quantizers.calibration.formats import awq_quantize

ALPHAS = 20
CLIP_RATIOS = 20  # 1.0, 0.975, ... 0.525
CLIP_TOKENS = 512


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w [N, K]`` through AWQ's 4-bit zero-point grid and back, float32."""
    q, zeros, scales = awq_quantize(w, group_size)  # [K, N], [K/g, N], [K/g, N]
    k, n = q.shape
    dq = (q.view(k // group_size, group_size, n) - zeros[:, None]) * scales.float()[:, None]
    return dq.reshape(k, n).t()


@torch.no_grad()
def search_scale(weights: list[torch.Tensor], x: torch.Tensor, mean_abs: torch.Tensor,
                 group_size: int) -> tuple[torch.Tensor, list[float]]:
    """(the best scale ``[K]``, the loss of each alpha) for the linears ``weights`` (each
    ``[N_i, K]``) that read ``x [T, K]``, whose mean ``|x|`` per channel is ``mean_abs [K]``."""
    w = torch.cat(weights).float()  # [sum N_i, K]
    reference = x @ w.T  # [T, sum N]
    best, best_loss, losses = torch.ones_like(mean_abs), float("inf"), []
    for alpha in torch.arange(ALPHAS) / ALPHAS:
        s = mean_abs.clamp(min=1e-4).pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        out = (x / s) @ fake_quantize(w * s, group_size).T
        loss = (out - reference).pow(2).mean().item()
        losses.append(loss)
        if loss < best_loss:
            best, best_loss = s, loss
    return best, losses


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w [N, K]`` clipped per output channel and input group to the best ratio of its max |w|."""
    n, k = w.shape
    groups = k // group_size
    x = x[torch.linspace(0, x.shape[0] - 1, min(CLIP_TOKENS, x.shape[0])).long()]  # [T, K]
    xg = x.view(-1, groups, group_size)  # [T, G, g]
    wg = w.float().view(n, groups, group_size)  # [N, G, g]
    reference = torch.einsum("tgc,ngc->ngt", xg, wg)  # each group's share of each output
    amax = wg.abs().amax(dim=2, keepdim=True)  # [N, G, 1]
    best_err = torch.full((n, groups), float("inf"))
    best_max = amax.clone()
    for i in range(CLIP_RATIOS):
        limit = amax * (1 - i / (2 * CLIP_RATIOS))
        clipped = torch.maximum(torch.minimum(wg, limit), -limit)
        q = fake_quantize(clipped.view(n, k), group_size).view(n, groups, group_size)
        err = (torch.einsum("tgc,ngc->ngt", xg, q) - reference).pow(2).mean(dim=2)  # [N, G]
        better = err < best_err
        best_err[better] = err[better]
        best_max[better] = limit[better]
    return torch.maximum(torch.minimum(wg, best_max), -best_max).view(n, k)
