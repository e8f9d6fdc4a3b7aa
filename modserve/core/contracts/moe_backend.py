"""The mixture-of-experts backend's contract (config key ``moe_backend``): how a layer's
experts run for the tokens routed to them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from pydantic import BaseModel


class MoEBackend(ABC):
    """How a mixture-of-experts layer computes its routed experts.

    Contract: ``forward`` returns, for every token row ``t``,
    ``sum_k topk_weights[t, k] * E_{topk_ids[t, k]}(x[t])`` with expert ``e``'s MLP
    ``E_e(x) = down[e](silu(gate_up[e](x)[:I]) * gate_up[e](x)[I:])``, where ``experts.gate_up``
    and ``experts.down`` are ``nn.ModuleList``s of this layer's ``Linear``s (made by the model's
    ``make_linear``: quantized or not, this rank's shard under tensor parallelism) and ``I`` is
    ``experts.gate_up[e]``'s output size over 2. Ids not in ``[0, len(experts.gate_up))`` add
    nothing. Every backend gives ``reference``'s result up to float error. ``prepare`` runs once
    per layer after the weights are loaded (stacking them, say); it may keep what it builds on
    ``experts``.
    """

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options

    def prepare(self, experts: torch.nn.Module) -> None:
        """Once per layer, after loading. Default: nothing."""

    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        topk_ids: torch.Tensor,  # [T, K] int64
        topk_weights: torch.Tensor,  # [T, K] float32
        experts: torch.nn.Module,
    ) -> torch.Tensor:  # [T, hidden] in x's dtype
        ...
