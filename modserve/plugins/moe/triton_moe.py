"""The triton MoE backend: a fused-MoE grouped GEMM in Triton, for unquantized experts on GPUs.

1. ``align``, in torch and without a host sync: the ``T*K`` assignments are sorted by expert
   (outsiders, ids not in ``[0, E)``, keyed ``E`` and dropped), each expert's run padded to a
   multiple of ``block_m`` with the id ``T*K`` (masked in the kernel). ``sorted_ids`` ``[P]``
   holds assignment ids ``t*K + k``; ``block_expert`` ``[P / block_m]`` the expert of each block,
   -1 past the last. ``P = T*K + E*(block_m - 1)`` rounded up: the grid depends on shapes only.
2. GEMM 1 (:func:`.triton_kernels.moe_gemm`): a grid over (row blocks, column blocks); each
   program multiplies its block's gathered token rows ``x[id // K]`` by its expert's ``w13``
   tile, writing ``gate_up`` ``[T*K, 2I]`` at the assignment's row.
3. SiLU-and-mul in torch: ``[T*K, I]``.
4. GEMM 2: the same kernel on ``w2``, each row multiplied by its routing weight, into a float32
   ``[T*K, hidden]`` (outsiders' rows stay zero); then the sum over the K slots (and over the
   ranks, once, under tensor parallelism).

``prepare`` stacks the weights as the fused backend does (:class:`.fused.FusedMoE`). Quantized
experts (and experts with biases) are run by the fused backend's per-expert Linear calls.
On CPU the kernel runs only under Triton's interpreter (``TRITON_INTERPRET=1`` before the
process starts; slow, for tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from modserve.api import MoEBackend
from modserve.plugins.moe.fused import FusedMoE, FusedMoEOptions, row_parallel_sum, stackable


class TritonMoEOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    block_m: int = Field(16, description="Rows (expert assignments) per program; a power of two >= 16")
    block_n: int = Field(64, description="Output columns per program; a power of two >= 16")
    block_k: int = Field(32, description="Inner-dimension step; a power of two >= 16")

    @field_validator("block_m", "block_n", "block_k")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value < 16 or value & (value - 1):
            raise ValueError(f"must be a power of two >= 16, got {value}")
        return value


class TritonMoE(MoEBackend):
    """Expert-sorted, block-padded rows through one Triton grouped GEMM per projection."""

    def __init__(self, options: TritonMoEOptions | None = None) -> None:
        super().__init__(options or TritonMoEOptions())
        try:
            from modserve.plugins.moe import triton_kernels
        except ImportError as e:
            raise ValueError(f"moe backend triton needs the triton package, which cannot be imported ({e})") \
                from None
        self.kernels = triton_kernels
        self.fused = FusedMoE(FusedMoEOptions(stack="on"))  # stacks float experts; runs quantized ones

    def check_device(self, device: torch.device) -> None:
        if device.type == "cpu" and not self.kernels.interpreted():
            raise ValueError("moe backend triton runs on a cpu device only under the Triton interpreter: "
                             "set TRITON_INTERPRET=1 before the process starts (slow; for tests)")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"moe backend triton runs on cuda devices (or cpu under the Triton interpreter), "
                             f"not {device.type}")

    def prepare(self, experts: nn.Module) -> None:
        self.fused.prepare(experts)  # stacks float experts; quantized ones stay as they are
        if hasattr(experts, "w13"):
            self.check_device(experts.w13.device)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: nn.Module) -> torch.Tensor:  # [T, hidden]
        if not hasattr(experts, "w13"):
            if stackable(experts):
                raise ValueError("moe backend triton: prepare(experts) must run (once, after loading) before "
                                 "forward, to stack the experts' weights")
            return self.fused.forward(x, topk_ids, topk_weights, experts)
        self.check_device(x.device)
        o = self.options
        w13, w2 = experts.w13, experts.w2  # [E, 2I, H], [E, H, I]
        tokens, k = topk_ids.shape
        sorted_ids, block_expert = align(topk_ids, w13.shape[0], o.block_m)
        gate_up = torch.empty(tokens * k, w13.shape[1], dtype=x.dtype, device=x.device)  # [T*K, 2I]
        self.kernels.moe_gemm(x, w13, gate_up, sorted_ids, block_expert, k, None, o.block_m, o.block_n, o.block_k)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up  # [T*K, I]; outsiders' rows are garbage, never read
        down = torch.zeros(tokens * k, x.shape[1], dtype=torch.float32, device=x.device)  # [T*K, hidden]
        weights = topk_weights.reshape(-1).float().contiguous()  # [T*K]
        self.kernels.moe_gemm(act, w2, down, sorted_ids, block_expert, 1, weights, o.block_m, o.block_n, o.block_k)
        out = down.view(tokens, k, -1).sum(1)  # [T, hidden] float32
        return row_parallel_sum(out, experts).to(x.dtype)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids ``[P]`` int32, block_expert ``[P / block_m]`` int32): the assignments grouped by
    expert, each expert's run padded to a multiple of ``block_m`` with the id ``T*K``. Device ops only."""
    ids = topk_ids.reshape(-1)  # [TK]
    n = ids.numel()
    keyed = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # outsiders keyed E
    order = torch.argsort(keyed, stable=True)  # [TK]
    sorted_experts = keyed[order]  # [TK]
    counts = torch.bincount(keyed, minlength=num_experts + 1)[:num_experts]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)  # [E]
    first = counts.cumsum(0) - counts  # [E]: where each expert's run starts in order
    e = sorted_experts.clamp(max=num_experts - 1)
    size = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m  # P: the most any routing needs
    pos = padded_end[e] - padded[e] + torch.arange(n, device=ids.device) - first[e]  # [TK]
    pos = torch.where(sorted_experts < num_experts, pos, size)  # outsiders written to a dropped slot
    sorted_ids = torch.full((size + 1,), n, dtype=torch.int32, device=ids.device)
    sorted_ids.scatter_(0, pos, order.to(torch.int32))
    block_starts = torch.arange(0, size, block_m, device=ids.device)  # [P / block_m]
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)  # E past the last run
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids[:size], block_expert
