"""The reference MoE backend: short and obviously right; every other backend is tested against it.

For each expert, the tokens routed to it (any of their top-k slots) are gathered, run through
its MLP, weighted, and added back into their rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modserve.api import MoEBackend


def expert_mlp(gate_up: nn.Module, down: nn.Module, x: torch.Tensor) -> torch.Tensor:  # [N, hidden]
    """One expert's SwiGLU MLP: ``down(silu(gate) * up)``, gate and up the halves of ``gate_up(x)``."""
    gate, up = gate_up(x).chunk(2, dim=-1)  # [N, I] each
    return down(F.silu(gate) * up)


class ReferenceMoE(MoEBackend):
    """A loop over experts, each on the tokens routed to it."""

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: nn.Module) -> torch.Tensor:  # [T, hidden]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, (gate_up, down) in enumerate(zip(experts.gate_up, experts.down)):
            rows, slot = torch.where(topk_ids == e)  # [N], [N]: token rows routed to e, and which of their k
            if rows.numel() == 0:
                continue
            y = expert_mlp(gate_up, down, x[rows])  # [N, hidden]
            out.index_add_(0, rows, y.float() * topk_weights[rows, slot, None])
        return out.to(x.dtype)
