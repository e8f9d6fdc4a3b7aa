"""The cuda platform's LoRA kernel: Punica's shrink and expand in Triton (vLLM's
``lora_shrink`` / ``lora_expand``), one launch of each per linear for all its slices and adapters.

Per step (the first linear that sees a new :class:`LoRAMapping` builds it, the others reuse it,
as vLLM's ``LoRAKernelMeta``): the groups' rows back to back ``rows`` ``[N]``, each group's
start ``starts`` ``[G + 1]``, slot ``slots`` ``[G]`` and scaling ``[G]``. Per linear: the shrink
writes ``x[rows] @ A^T`` of every slice into a float32 ``h`` ``[S, T, max_rank]``, the expand adds
``h @ B^T * scaling`` into each slice's columns of ``y`` (:mod:`.lora_kernels`).

On CPU tensors it runs only under Triton's interpreter (``TRITON_INTERPRET=1`` before the
process starts; slow, for tests): :meth:`CudaPlatform.lora_kernel` offers it on CUDA only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modserve.api import LoRAKernel, LoRAMapping


@dataclass(frozen=True, slots=True)
class _Groups:
    """One step's groups as the kernels read them."""

    rows: torch.Tensor  # [N] int32: group 0's batch rows, then group 1's, ...
    starts: torch.Tensor  # [G + 1] int32: group g is rows[starts[g]:starts[g + 1]]
    slots: torch.Tensor  # [G] int32
    scaling: torch.Tensor  # [G] float32
    max_rows: int  # the largest group's rows: the grid's row tiles


class TritonLoRAKernel(LoRAKernel):
    """Adapter-sorted rows through one shrink and one expand launch per call (up to 3 slices each)."""

    def __init__(self) -> None:
        try:
            from modserve.plugins.platforms.cuda import lora_kernels
        except ImportError as e:
            raise ValueError(f"the Triton LoRA kernel needs the triton package, which cannot be imported ({e})") \
                from None
        self.kernels = lora_kernels
        # The last mapping seen (held, so its id cannot be reused) and what it was built with
        self._mapping: LoRAMapping | None = None
        self._key: tuple = ()
        self._groups: _Groups | None = None

    def check_device(self, device: torch.device) -> None:
        if device.type == "cpu" and not self.kernels.interpreted():
            raise ValueError("the Triton LoRA kernel runs on a cpu device only under the Triton interpreter: "
                             "set TRITON_INTERPRET=1 before the process starts (slow; for tests)")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"the Triton LoRA kernel runs on cuda devices (or cpu under the Triton interpreter), "
                             f"not {device.type}")

    def add(self, y: torch.Tensor, x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor],
            scaling: list[float], mapping: LoRAMapping) -> None:
        groups = self._prepare(mapping, x, scaling)
        if groups is None:
            return
        a = [t.contiguous() for t in a]
        b = [t.contiguous() for t in b]
        h = torch.empty(len(a), x.shape[0], a[0].shape[1], dtype=torch.float32, device=x.device)  # [S, T, R]
        column_starts = [sum(t.shape[1] for t in b[:i]) for i in range(len(b))]
        block_m = max(16, min(64, 1 << (groups.max_rows - 1).bit_length()))
        step = self.kernels.MAX_SLICES
        for i in range(0, len(a), step):  # one launch each for up to 3 slices
            part = slice(i, i + step)
            self.kernels.shrink(x, a[part], h[part], groups.rows, groups.starts, groups.slots, groups.max_rows,
                                block_m)
            self.kernels.expand(h[part], b[part], y, column_starts[part], groups.rows, groups.starts, groups.slots,
                                groups.scaling, groups.max_rows, block_m)

    def _prepare(self, mapping: LoRAMapping, x: torch.Tensor, scaling: list[float]) -> _Groups | None:
        """The step's groups, built once per mapping (and per batch size and scalings); None: no rows."""
        num_rows = x.shape[0]
        key = (num_rows, x.device, tuple(scaling[slot] for slot, _ in mapping.groups))
        if mapping is self._mapping and key == self._key:
            return self._groups
        self.check_device(x.device)
        rows = [torch.arange(num_rows, device=x.device) if r is None else r for _, r in mapping.groups]
        sizes = [r.numel() for r in rows]
        self._mapping, self._key, self._groups = mapping, key, None
        if sum(sizes) == 0:
            return None
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        info = torch.tensor(starts + [slot for slot, _ in mapping.groups], dtype=torch.int32).to(x.device)
        self._groups = _Groups(
            rows=torch.cat(rows).to(torch.int32), starts=info[:len(starts)], slots=info[len(starts):],
            scaling=torch.tensor(key[2], dtype=torch.float32).to(x.device), max_rows=max(sizes))
        return self._groups
