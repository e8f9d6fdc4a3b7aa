"""The quantizer's contract (config key ``quantization``): how a linear stores, loads and
multiplies its weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel


@dataclass(frozen=True, slots=True)
class LinearSpec:
    """One linear layer as the model declares it: ``y = x @ W.T + b`` with ``W: [out, in]``.

    ``shard_sizes`` lists the output rows of each checkpoint tensor fused into the layer,
    in order (q, k, v for a fused qkv_proj); ``(out_features,)`` for an unfused layer.

    Under tensor parallelism the sizes are this rank's: a ``column`` layer holds rows
    ``shard_starts[i]:+shard_sizes[i]`` of each checkpoint shard, a ``row`` layer inputs
    ``in_start:+in_features`` (and all-reduces its output). The core slices each checkpoint
    tensor along the dimensions :meth:`Quantizer.tensor_layout` names before
    ``load_weight`` sees it, so a quantizer loads a rank's tensors as a whole layer's.
    """

    in_features: int
    out_features: int
    shard_sizes: tuple[int, ...]
    bias: bool
    dtype: torch.dtype  # activations, and the weights of an unquantized layer
    device: torch.device  # where the weights will live (kernels are chosen by it)
    parallel: str | None = None  # "column", "row" or None (replicated: every rank holds it whole)
    tp_size: int = 1
    shard_starts: tuple[int, ...] = ()  # column: this rank's first row in each checkpoint shard
    in_start: int = 0  # row: this rank's first input channel

    def shard_offset(self, shard: int) -> int:
        return sum(self.shard_sizes[:shard])

    @property
    def full_in_features(self) -> int:
        """The checkpoint's input channels (``in_features`` but for a row-parallel shard)."""
        return self.in_features * self.tp_size if self.parallel == "row" else self.in_features


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where a checkpoint tensor of a linear keeps its output and input channels: the
    dimension of each (None: not split, every rank loads it whole) and how many channels
    one element covers along it (8 int4 values packed in an int32; a group's scale)."""

    out_dim: int | None = 0
    in_dim: int | None = 1
    out_per_element: int = 1
    in_per_element: int = 1


class Quantizer(ABC):
    """How every quantized linear layer of a model stores its weights and runs its matmul.

    One instance per engine. For each :class:`~modserve.runner.linear.Linear` the core calls,
    in this order:

    1. ``create_weights(layer, spec)`` while the model is built on the "meta" device:
       register on ``layer`` every tensor the layer keeps (``torch.nn.Parameter`` with
       ``requires_grad=False`` or buffers), in its final dtype. ``layer.bias`` (float,
       ``[out]``) is the core's.
    2. ``load_weight(layer, name, tensor, shard)`` once per checkpoint tensor of the layer:
       ``name`` is the tensor's last name part (``"weight"``, ``"qweight"``, ...), ``shard``
       indexes ``spec.shard_sizes``. Fused shards arrive in any order; a name the quantizer
       does not read is an error naming it.
    3. ``process_weights(layer)`` once, after every tensor is loaded: repack for a kernel,
       drop staging tensors.
    4. ``apply(layer, x)`` on every forward: ``x: [T, in]`` in ``spec.dtype`` to
       ``[T, out]``, plus ``layer.bias`` when it is not None.

    ``dequantize(layer)`` returns the ``[out, in]`` float32 weight the layer stands for,
    exactly (the tests compare it bit for bit with a reference dequantization), and
    ``weight_bytes(spec)`` the bytes the layer keeps after ``process_weights``, for
    capacity planning (the tests check it against what the engine allocated).

    A quantizer for pre-quantized checkpoints names the ``quantization_config.quant_method``
    values it reads in ``checkpoint_methods`` and receives that config as ``checkpoint_config``;
    one that quantizes a float checkpoint at load leaves it empty.
    """

    checkpoint_methods: tuple[str, ...] = ()

    def __init__(self, checkpoint_config: dict[str, Any] | None = None,
                 options: BaseModel | None = None) -> None:
        self.checkpoint_config = checkpoint_config or {}
        self.options = options

    def tensor_names(self, spec: LinearSpec) -> tuple[str, ...]:
        """Checkpoint tensors every shard of a layer must provide (besides its bias)."""
        return ("weight",)

    def tensor_layout(self, name: str, spec: LinearSpec) -> TensorLayout:
        """How checkpoint tensor ``name`` splits under tensor parallelism. Default: an
        ``[out, in]`` weight. Only asked when ``spec.tp_size > 1``."""
        return TensorLayout()

    @abstractmethod
    def create_weights(self, layer: torch.nn.Module, spec: LinearSpec) -> None: ...

    @abstractmethod
    def load_weight(self, layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard: int) -> None: ...

    def process_weights(self, layer: torch.nn.Module) -> None:
        """Called once after loading. Default: nothing."""

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def dequantize(self, layer: torch.nn.Module) -> torch.Tensor:  # [out, in] float32
        ...

    @abstractmethod
    def weight_bytes(self, spec: LinearSpec) -> int: ...

    def traceable(self) -> bool:
        """Asked once every layer's weights are processed: whether ``apply`` traces under
        ``torch.compile`` (every op it calls has a fake kernel; no Python state changes
        between calls), so ``compile: auto`` may compile the model as an unquantized one.
        Default: False (the model runs eagerly unless ``compile: on``)."""
        return False

    def native_op(self, layer: torch.nn.Module) -> tuple[str, list[torch.Tensor | None]] | None:
        """``apply(layer, x)`` as one registered op, for callers with no Python between ops (a
        platform's native decode step): the op's qualified name and the arguments after ``x``,
        such that ``op(x, *args)`` returns what ``apply`` does for float32 ``x [T, in]``, any
        ``T``. Asked after ``process_weights``. Default: None (no such op)."""
        return None
