"""The fused MoE backend: sort once, one GEMM per expert on a contiguous slice, scatter once.

The ``T*K`` (token, slot) assignments are sorted by expert id (a stable argsort of the
flattened ids), so each expert's rows form one contiguous slice of a gathered ``[N, hidden]``
buffer; the slice sizes come from one bincount. Each expert's MLP runs on its slice, the
results are multiplied by their routing weights and added back into their token rows by a
single ``index_add_`` in float32.

Ids outside ``[0, E)`` (another rank's experts under expert parallelism) are keyed ``E`` before
sorting, so they sort last and are cut off before the gather: they cost nothing and add nothing.

Where the experts live on a GPU (``stack: auto``), ``prepare`` stacks unquantized, bias-free
experts into ``experts.w13`` ``[E, 2I, H]`` and
``experts.w2`` ``[E, H, I]``, then points each Linear's ``weight`` at its row of the stack, so
the weights are kept once. Forward then multiplies the slices by the stacks, through one
``grouped_mm`` where this torch runs it for the device and dtype (probed in ``prepare``), else
by a matmul per expert. Quantized experts, experts with biases, and experts that were never
prepared are run by calling their Linear modules on the slices. So are experts on a CPU: there
the platform's linear method (16-feature panels for a C++ GEMM, packed at load) beats a matmul
over the stacks; measured on a Mixtral-shaped model, stacked experts ran a workload 1.9x slower.

Under tensor parallelism (row-parallel ``down``) the stacked path all-reduces its output once,
where the Linears all-reduce once per expert called.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from typing import Literal

from pydantic import BaseModel, Field

from modserve.api import MoEBackend, Unquantized, param

GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class FusedMoEOptions(BaseModel):
    stack: Literal["auto", "on", "off"] = Field(
        "auto", description="Stack float experts' weights for one grouped GEMM per projection; auto: on a GPU "
        "(on a CPU the platform's linear method is faster)")


class FusedMoE(MoEBackend):
    """Sorted by expert once; one GEMM (or grouped GEMM) per expert slice; one scatter-add."""

    def __init__(self, options: FusedMoEOptions | None = None) -> None:
        super().__init__(options or FusedMoEOptions())

    def prepare(self, experts: nn.Module) -> None:
        stack = self.options.stack
        if stack == "off" or not stackable(experts) or (stack == "auto" and experts.gate_up[0].weight.device.type
                                                        == "cpu"):
            return
        with torch.no_grad():
            w13 = torch.stack([lin.weight for lin in experts.gate_up])  # [E, 2I, H]
            w2 = torch.stack([lin.weight for lin in experts.down])  # [E, H, I]
        # NOTE: plain attributes, not buffers: state_dict and model_bytes see the Linears' weights,
        # which from here on are views of these stacks (one copy of the weights, not two).
        for e, (gate_up, down) in enumerate(zip(experts.gate_up, experts.down)):
            gate_up.weight = param(w13[e])
            down.weight = param(w2[e])
        experts.w13, experts.w2 = w13, w2
        experts.use_grouped_mm = grouped_mm_works(w13, w2)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: nn.Module) -> torch.Tensor:  # [T, hidden]
        num_experts, k = len(experts.gate_up), topk_ids.shape[1]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        ids = topk_ids.reshape(-1)  # [T*K]
        ids = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # outsiders keyed E: sorted last
        order = torch.argsort(ids, stable=True)  # [T*K]: assignments grouped by expert
        # NOTE: the one host sync per layer: the slice bounds must be Python ints to slice and to
        # call the Linears. Fine on CPU; on a GPU it stalls the stream (and rules out graph capture).
        counts = torch.bincount(ids, minlength=num_experts + 1)[:num_experts].tolist()  # [E]
        n = sum(counts)
        if n == 0:
            return out.to(x.dtype)
        order = order[:n]  # [N]: the in-range assignments
        rows = order // k  # [N]: their token rows
        xs = x[rows]  # [N, hidden], contiguous per expert
        stacked = hasattr(experts, "w13")
        ys = stacked_mlp(xs, counts, experts) if stacked else linear_mlp(xs, counts, experts)  # [N, hidden]
        weights = topk_weights.reshape(-1)[order, None]  # [N, 1]
        out.index_add_(0, rows, ys.float() * weights)
        return (row_parallel_sum(out, experts) if stacked else out).to(x.dtype)


def row_parallel_sum(out: torch.Tensor, experts: nn.Module) -> torch.Tensor:  # [T, hidden]
    """The ranks' partial sums under tensor parallelism, where the stacked weights bypassed the
    row-parallel ``down`` Linears (each of which all-reduces its own output): once per layer."""
    down = experts.down[0]
    return down.tp.all_reduce(out) if down.spec.parallel == "row" else out


def stackable(experts: nn.Module) -> bool:
    """Every expert Linear a float, bias-free one: its ``weight`` is all there is to it."""
    linears = [*experts.gate_up, *experts.down]
    return bool(linears) and all(isinstance(lin.quantizer, Unquantized) and lin.bias is None for lin in linears)


def grouped_mm_works(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether this torch's grouped GEMM runs these stacks (CUDA's wants recent GPUs, 16-bit types
    and aligned strides; torch's CPU one takes float32 too): one row per expert, once per layer."""
    if GROUPED_MM is None:
        return False
    num_experts, hidden, inter = w2.shape
    offs = torch.arange(1, num_experts + 1, device=w13.device, dtype=torch.int32)  # [E]: one row each
    try:
        GROUPED_MM(torch.zeros(num_experts, hidden, device=w13.device, dtype=w13.dtype), w13.transpose(1, 2), offs=offs)
        GROUPED_MM(torch.zeros(num_experts, inter, device=w2.device, dtype=w2.dtype), w2.transpose(1, 2), offs=offs)
        return True
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


def slices(counts: list[int]) -> list[tuple[int, int, int]]:
    """(expert, start, end) of every expert that got rows, from the per-expert counts."""
    found, start = [], 0
    for e, c in enumerate(counts):
        if c:
            found.append((e, start, start + c))
        start += c
    return found


def stacked_mlp(xs: torch.Tensor, counts: list[int], experts: nn.Module) -> torch.Tensor:  # [N, hidden]
    """The experts' SwiGLU MLPs on their slices of ``xs`` [N, hidden], from the stacked weights."""
    w13, w2 = experts.w13, experts.w2  # [E, 2I, H], [E, H, I]
    if experts.use_grouped_mm:
        offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(xs.device)  # [E] slice ends
        h = GROUPED_MM(xs, w13.transpose(1, 2), offs=offs)  # [N, 2I]
        gate, up = h.chunk(2, dim=-1)
        return GROUPED_MM(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)  # [N, hidden]
    ys = torch.empty_like(xs)
    for e, start, end in slices(counts):
        gate, up = (xs[start:end] @ w13[e].t()).chunk(2, dim=-1)  # [n_e, I] each
        ys[start:end] = (F.silu(gate) * up) @ w2[e].t()
    return ys


def linear_mlp(xs: torch.Tensor, counts: list[int], experts: nn.Module) -> torch.Tensor:  # [N, hidden]
    """The experts' MLPs on their slices, by calling their Linears (quantized ones, any others)."""
    ys = torch.empty_like(xs)
    for e, start, end in slices(counts):
        gate, up = experts.gate_up[e](xs[start:end]).chunk(2, dim=-1)  # [n_e, I] each
        ys[start:end] = experts.down[e](F.silu(gate) * up)
    return ys
