"""The LoRA kernel's contract (a platform's :meth:`~modserve.core.contracts.platform.Platform.lora_kernel`):
adds the low-rank updates of several adapters to one batch's linear output, row by row."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LoRAMapping:
    """Which adapter slot each row of one step's batch uses.

    ``groups``: ``(slot, rows)`` per slot used, rows an int64 index tensor ``[n]`` into the
    batch, or None for every row (a step whose rows all use that slot). Rows of no adapter
    are in no group. ``ranks``: per group, its adapter's rank ``r`` (A and B are zero past it:
    a kernel may skip the padding), or None for ``max_rank``."""

    groups: list[tuple[int, torch.Tensor | None]]
    ranks: list[int] | None = None


class LoRAKernel(ABC):
    """Contract: ``add`` changes ``y`` in place and nothing else; for each group and each output
    slice ``i``, ``y[rows, slice_i] += (x[rows] @ a[i][slot].T) @ b[i][slot].T * scaling[slot]``,
    the shrink then the expand, in that order (the reference's rounding)."""

    @abstractmethod
    def add(self, y: torch.Tensor, x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor],
            scaling: list[float], mapping: LoRAMapping) -> None:
        """``y`` ``[T, sum(out_i)]``, ``x`` ``[T, in]``; ``a[i]`` ``[max_loras, max_rank, in]`` and
        ``b[i]`` ``[max_loras, out_i, max_rank]`` per output slice (q, k, v of a fused qkv), zero
        past each adapter's rank; ``scaling[slot]`` the adapter's ``alpha / r`` (rsLoRA: ``/ sqrt(r)``)."""
