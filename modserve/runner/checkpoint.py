"""Checkpoint tensors as handles that read only the part a rank keeps.

:func:`modserve.runner.loader.iter_weights` yields ``(name, CheckpointTensor)``: the tensor's
shape and dtype, nothing read yet. ``narrow``, ``[...]`` and ``chunk`` give handles to a part;
``read()`` reads that part alone (safetensors' ``get_slice``). So a tensor-parallel rank reads
its rows or columns of each weight, and a tensor a rank drops (another pipeline stage's layer,
another rank's expert) is never read. Every byte read is counted in :class:`CheckpointReads`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# safetensors' dtype names -> torch's (those this torch knows)
DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("I16", "int16"), ("U16", "uint16"), ("I32", "int32"),
    ("U32", "uint32"), ("I64", "int64"), ("U64", "uint64"), ("F16", "float16"), ("BF16", "bfloat16"),
    ("F32", "float32"), ("F64", "float64"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"))
    if hasattr(torch, attr)}


@dataclass(slots=True)
class CheckpointReads:
    """What one rank read: ``read`` bytes of the ``size`` bytes of tensor data in the checkpoint."""

    read: int = 0
    size: int = 0

    def add(self, t: torch.Tensor) -> torch.Tensor:
        self.read += t.numel() * t.element_size()
        return t


class CheckpointTensor:
    """A part of one stored tensor, unread. ``index`` holds one entry per stored dimension: a
    ``slice`` (start, stop; kept as a dimension) or an ``int`` (indexed away, as ``t[e]`` does)."""

    __slots__ = ("source", "name", "stored", "index", "dtype", "reads")

    def __init__(self, source: Any, name: str, stored: tuple[int, ...], dtype: torch.dtype | None,
                 reads: CheckpointReads, index: tuple[slice | int, ...] | None = None) -> None:
        self.source, self.name, self.stored, self.dtype, self.reads = source, name, stored, dtype, reads
        self.index = index if index is not None else tuple(slice(0, n) for n in stored)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(s.stop - s.start for s in self.index if isinstance(s, slice))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return self.ndim

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise IndexError(f"{self.name}: narrow({dim}, {start}, {length}) outside shape {tuple(self.shape)}")
        return self._at(dim, slice(start, start + length))

    def chunk(self, chunks: int, dim: int = 0) -> list[CheckpointTensor]:
        """As ``torch.chunk``: parts of ``ceil(size / chunks)`` along ``dim``, the last maybe smaller."""
        size = self.shape[dim]
        step = -(-size // chunks)
        return [self.narrow(dim, s, min(step, size - s)) for s in range(0, size, step)]

    def __getitem__(self, key: Any) -> CheckpointTensor:
        keys = key if isinstance(key, tuple) else (key,)
        if len(keys) > self.ndim:
            raise IndexError(f"{self.name}: {len(keys)} indices for {self.ndim} dimensions")
        out, dim = self, 0
        for k in keys:
            size = out.shape[dim]
            if isinstance(k, int):
                if not -size <= k < size:
                    raise IndexError(f"{self.name}: index {k} outside dimension {dim} of size {size}")
                out = out._at(dim, k % size)  # the dimension goes: the next key indexes the next one
            elif isinstance(k, slice) and k.step in (None, 1):
                start, stop, _ = k.indices(size)
                out, dim = out._at(dim, slice(start, max(start, stop))), dim + 1
            else:
                raise TypeError(f"{self.name}: a checkpoint tensor takes ints and step-1 slices, not {k!r}")
        return out

    def _at(self, dim: int, key: slice | int) -> CheckpointTensor:
        """Dimension ``dim`` of this part (counted among the kept ones) narrowed to ``key``,
        relative to this part's start there."""
        stored = [i for i, s in enumerate(self.index) if isinstance(s, slice)][dim]
        base = self.index[stored].start
        new = base + key if isinstance(key, int) else slice(base + key.start, base + key.stop)
        index = self.index[:stored] + (new,) + self.index[stored + 1:]
        return CheckpointTensor(self.source, self.name, self.stored, self.dtype, self.reads, index)

    def read(self) -> torch.Tensor:
        """This part from disk (counted), a tensor of its own."""
        whole = all(isinstance(s, slice) and (s.start, s.stop) == (0, n) for s, n in zip(self.index, self.stored))
        if isinstance(self.source, torch.Tensor):  # a pytorch_model*.bin tensor, memory-mapped
            return self.reads.add(self.source[self.index].clone())
        if whole:
            return self.reads.add(self.source.get_tensor(self.name))
        return self.reads.add(self.source.get_slice(self.name)[self.index])

    def __repr__(self) -> str:
        return f"CheckpointTensor({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def as_tensor(t: torch.Tensor | CheckpointTensor) -> torch.Tensor:
    """A tensor as it is, or a checkpoint part read now."""
    return t.read() if isinstance(t, CheckpointTensor) else t
