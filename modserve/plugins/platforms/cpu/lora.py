"""The cpu platform's LoRA kernel: every adapter and slice of one linear in one C++ call
(``csrc/lora.cpp``, ``torch.ops.modserve_lora.add``).

Per step (the first linear that sees a new :class:`LoRAMapping` builds it, the others reuse
it, as the Triton kernel does): the groups' rows back to back ``rows`` ``[N]`` int64, per group
``(first, count, slot, rank)`` ``[G, 4]`` int64 and its scaling ``[G]`` float32. Per B tensor,
a transposed copy ``[max_loras, max_rank, out]`` the expand reads, made again whenever B changed
(an adapter loaded into a slot or cleared: its version counter moved).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modserve.api import LoRAKernel, LoRAMapping
from modserve.plugins.platforms.cpu.kernels import CSRC, load_kernel

LORA_KERNEL = CSRC / "lora.cpp"


def lora_kernel_problem() -> str | None:
    """None once ``torch.ops.modserve_lora.add`` is loaded (built on first use), else why not."""
    return load_kernel("modserve_cpu_lora", str(LORA_KERNEL))


@dataclass(frozen=True, slots=True)
class _Groups:
    rows: torch.Tensor  # [N] int64: group 0's batch rows, then group 1's, ...
    groups: torch.Tensor  # [G, 4] int64: first (into rows), count, slot, rank
    scaling: torch.Tensor  # [G] float32


class CppLoRAKernel(LoRAKernel):
    """The shrink and expand of every group and slice of a linear in one op, float32 sums."""

    def __init__(self) -> None:
        if problem := lora_kernel_problem():
            raise ValueError(f"the C++ LoRA kernel cannot be built: {problem}")
        self._op = torch.ops.modserve_lora.add
        # The last mapping seen (held, so its id cannot be reused) and what it was built with
        self._mapping: LoRAMapping | None = None
        self._key: tuple = ()
        self._groups: _Groups | None = None
        self._transposed: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # id(B) -> (B, version, B^T)

    def add(self, y: torch.Tensor, x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor],
            scaling: list[float], mapping: LoRAMapping) -> None:
        groups = self._prepare(mapping, x.shape[0], a[0].shape[1], scaling)
        if x.stride(-1) != 1:
            x = x.contiguous()
        bt = [self._transpose(b_i) for b_i in b]
        if y.stride(-1) == 1:
            self._op(y, x, a, bt, groups.rows, groups.groups, groups.scaling)
        else:  # the op writes rows of contiguous columns; other rows are copied back unchanged
            out = y.contiguous()
            self._op(out, x, a, bt, groups.rows, groups.groups, groups.scaling)
            y.copy_(out)

    def _transpose(self, b: torch.Tensor) -> torch.Tensor:
        """B ``[L, out, R]`` as ``[L, R, out]``, copied again only when B changed since."""
        held = self._transposed.get(id(b))
        if held is None or held[0] is not b or held[1] != b._version:
            held = (b, b._version, b.transpose(1, 2).contiguous())
            self._transposed[id(b)] = held
        return held[2]

    def _prepare(self, mapping: LoRAMapping, num_rows: int, max_rank: int, scaling: list[float]) -> _Groups:
        """The step's groups, built once per mapping (and per batch size and scalings)."""
        key = (num_rows, tuple(scaling[slot] for slot, _ in mapping.groups))
        if mapping is self._mapping and key == self._key and self._groups is not None:
            return self._groups
        rows = [torch.arange(num_rows) if r is None else r.to(torch.int64) for _, r in mapping.groups]
        ranks = mapping.ranks or [max_rank] * len(rows)
        table, first = [], 0
        for (slot, _), r, rank in zip(mapping.groups, rows, ranks):
            table.append((first, r.numel(), slot, rank))
            first += r.numel()
        self._mapping, self._key = mapping, key
        self._groups = _Groups(torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64),
                               torch.tensor(table, dtype=torch.int64).reshape(-1, 4),
                               torch.tensor(key[1], dtype=torch.float32))
        return self._groups
