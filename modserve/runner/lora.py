"""LoRA adapters on the model's linears: per-slot weights, the step's row mapping, the reference kernel.

``enable_lora`` gives every projection a :class:`LinearLoRA` holding ``max_loras`` slots of
adapter weights (zero-padded to ``max_lora_rank``); the layer applies its base weight
(whatever the quantizer), then the platform's :class:`LoRAKernel` adds each row's adapter.
Which slot each row uses comes out of band, from :func:`lora_mapping` around the forward,
as attention's metadata does from the forward context.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from modserve.core.contracts.lora import LoRAKernel, LoRAMapping
from modserve.core.lora_request import LoRARequest
from modserve.runner.linear import Linear
from modserve.runner.lora_adapter import LoRAAdapter, load_adapter

_local = threading.local()
_layers: weakref.WeakValueDictionary[int, LinearLoRA] = weakref.WeakValueDictionary()  # index -> layer
_indices = itertools.count()


@torch.library.custom_op("modserve::lora_add", mutates_args=("y",))
def _lora_add_op(y: torch.Tensor, x: torch.Tensor, index: int) -> None:
    """Layer ``index``'s update under torch.compile: opaque to dynamo, as attention is, so each
    step's mapping is read here, eagerly, and one graph serves every step and layer (the index,
    an int on the Linear module, is a graph input)."""
    _layers[index](y, x)


@_lora_add_op.register_fake
def _(y: torch.Tensor, x: torch.Tensor, index: int) -> None:
    return None


class TorchLoRAKernel(LoRAKernel):
    """The reference, any device: per slot used, gather its rows, shrink, expand, scatter-add."""

    def add(self, y, x, a, b, scaling, mapping) -> None:
        for slot, rows in mapping.groups:
            xs = x if rows is None else x[rows]  # [n, in]
            start = 0
            for a_i, b_i in zip(a, b):
                out = b_i.shape[1]
                delta = (xs @ a_i[slot].T) @ b_i[slot].T * scaling[slot]  # [n, r] -> [n, out_i]
                if rows is None:
                    y[:, start:start + out] += delta
                else:
                    y[rows, start:start + out] += delta
                start += out


def mapping_rows(mapping: LoRAMapping | None, start: int, end: int) -> LoRAMapping | None:
    """The part of ``mapping`` for rows ``start:end`` of its batch, renumbered from ``start``
    (a pipeline micro-batch's rows); None where no row of the part has an adapter."""
    if mapping is None:
        return None
    groups, ranks = [], []
    for i, (slot, rows) in enumerate(mapping.groups):
        if rows is not None:
            rows = rows[(rows >= start) & (rows < end)] - start
            if not rows.numel():
                continue
        groups.append((slot, rows))
        ranks.append(mapping.ranks[i] if mapping.ranks is not None else None)
    if not groups:
        return None
    return LoRAMapping(groups, ranks if mapping.ranks is not None else None)


@contextlib.contextmanager
def lora_mapping(mapping: LoRAMapping | None) -> Iterator[None]:
    """The slots of the rows of the forward run inside (None: no adapter on any row)."""
    _local.mapping = mapping
    try:
        yield
    finally:
        _local.mapping = None


class LinearLoRA:
    """One linear's adapter slots: per output shard ``a`` ``[max_loras, max_rank, in]`` and
    ``b`` ``[max_loras, out_shard, max_rank]``, this rank's part under tensor parallelism
    (column-parallel: B's rows; row-parallel: A's columns, the partial sums reduced with the
    base output's)."""

    def __init__(self, linear: nn.Module, max_loras: int, max_rank: int, kernel: LoRAKernel,
                 scaling: list[float]) -> None:
        spec = linear.spec
        self.spec, self.kernel, self.scaling = spec, kernel, scaling
        new = dict(dtype=spec.dtype, device=spec.device)
        self.a = [torch.zeros(max_loras, max_rank, spec.in_features, **new) for _ in spec.shard_sizes]
        self.b = [torch.zeros(max_loras, size, max_rank, **new) for size in spec.shard_sizes]
        self.index = next(_indices)  # the compiled path's name for it (_lora_add_op)
        _layers[self.index] = self

    def __call__(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # y [T, out] += x [T, in]'s update
        mapping: LoRAMapping | None = getattr(_local, "mapping", None)
        if mapping is not None and mapping.groups:
            self.kernel.add(y, x, self.a, self.b, self.scaling, mapping)
        return y

    def clear(self, slot: int) -> None:
        for t in (*self.a, *self.b):
            t[slot].zero_()

    def set(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """A ``[r, in]`` and B ``[out, r]`` of output shard ``shard``, whole as the adapter has them."""
        spec = self.spec
        if spec.parallel == "column":
            b = b.narrow(0, spec.shard_starts[shard], spec.shard_sizes[shard])
        elif spec.parallel == "row":
            a = a.narrow(1, spec.in_start, spec.in_features)
        r = a.shape[0]
        want_a, want_b = (r, spec.in_features), (spec.shard_sizes[shard], r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ValueError(f"LoRA weights of shape {tuple(a.shape)}, {tuple(b.shape)} do not fit this layer "
                             f"(expected {want_a}, {want_b}): an adapter of another base model?")
        self.a[shard][slot, :r].copy_(a)
        self.b[shard][slot, :, :r].copy_(b)


@dataclass(frozen=True, slots=True)
class LoRAStep:
    """One step's adapters, as rank 0 sends it: each adapter used and the batch rows it covers."""

    requests: list[LoRARequest]
    rows: list[list[int]]  # per request, its rows (increasing)
    num_rows: int  # the step's rows


class LoRASlots:
    """The model's adapters: ``max_loras`` device slots (the step's adapters take slots, the
    least recently used other adapter leaving one) and up to ``max_cpu_loras`` adapters
    cached in host memory (least recently used dropped first)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int,
                 kernel: LoRAKernel) -> None:
        locate = getattr(model, "locate", None)
        if locate is None:
            raise ValueError(f"{type(model).__name__} does not support LoRA adapters (enable_lora)")
        self.locate, self.max_rank, self.max_cpu_loras = locate, max_rank, max_cpu_loras
        self.scaling = [0.0] * max_loras
        self.ranks = [max_rank] * max_loras  # slot -> its adapter's rank (zero past it)
        self.layers: dict[str, LinearLoRA] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                module.lora = LinearLoRA(module, max_loras, max_rank, kernel, self.scaling)
                module.lora_index = module.lora.index
                self.layers[name] = module.lora
        # another pipeline stage's layers: placeholders here, their adapter weights skipped
        self.elsewhere = {name for name, module in model.named_modules() if isinstance(module, nn.Identity)}
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.free = list(range(max_loras))
        self.held: list[LoRARequest | None] = [None] * max_loras  # slot -> the adapter in it
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """Its weights from the host cache, else from its directory (a ValueError if unusable)."""
        if (cached := self.host.get(request.lora_int_id)) is not None and cached.request == request:
            self.host.move_to_end(request.lora_int_id)
            return cached
        adapter = load_adapter(request, self.max_rank)
        for module in adapter.weights:
            if self.locate(module)[0] not in self.layers and not self._elsewhere(module):
                raise ValueError(f"LoRA adapter {request.lora_name!r}: module {module!r} is no projection of "
                                 "this model")
        self.host[request.lora_int_id] = adapter
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    def _elsewhere(self, module: str) -> bool:
        """Whether ``module`` is in a layer another pipeline stage holds."""
        parts = module.split(".")
        return any(".".join(parts[:i]) in self.elsewhere for i in range(1, len(parts)))

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (unloaded): its slot frees, its host copy goes. Whether it was known."""
        known = self.host.pop(lora_int_id, None) is not None
        if (slot := self.slots.pop(lora_int_id, None)) is not None:
            self.free.append(slot)
            known = True
        return known

    def activate(self, step: LoRAStep | None) -> LoRAMapping | None:
        """Put the step's adapters in slots (at most ``max_loras``: the scheduler's bound) and map its rows."""
        if step is None or not step.requests:
            return None
        groups, in_step = [], {r.lora_int_id for r in step.requests}
        for request, rows in zip(step.requests, step.rows):
            slot = self._slot(request, in_step)
            index = None if len(rows) == step.num_rows else torch.tensor(rows, dtype=torch.int64,
                                                                          device=self._device())
            groups.append((slot, index))
        return LoRAMapping(groups, [self.ranks[slot] for slot, _ in groups])

    def _slot(self, request: LoRARequest, in_step: set[int]) -> int:
        key = request.lora_int_id
        if key in self.slots and self.held[self.slots[key]] == request:
            self.slots.move_to_end(key)
            return self.slots[key]
        adapter = self.adapter(request)  # first: an adapter that cannot be read takes no slot
        if key in self.slots:  # the same id, another adapter (unloaded and loaded again): its slot reloaded
            self.free.append(self.slots.pop(key))
        if not self.free:
            victim = next((k for k in self.slots if k not in in_step), None)
            if victim is None:
                raise RuntimeError(f"a step uses more adapters than the {len(self.scaling)} slots (max_loras)")
            self.free.append(self.slots.pop(victim))
        slot = self.free.pop(0)
        with torch.no_grad():
            for layer in self.layers.values():
                layer.clear(slot)
            for module, (a, b) in adapter.weights.items():
                target, shard = self.locate(module)
                if target not in self.layers:  # another stage's (checked by adapter())
                    continue
                layer = self.layers[target]
                layer.set(slot, shard, a.to(layer.spec.dtype), b.to(layer.spec.dtype))
        self.scaling[slot], self.ranks[slot] = adapter.scaling, adapter.rank
        self.slots[key], self.held[slot] = slot, request
        return slot

    def _device(self) -> torch.device:
        return next(iter(self.layers.values())).a[0].device
