"""Linear layers whose weights a :class:`~modserve.core.interfaces.Quantizer` owns.

A model asks for its projections through ``make_linear(in, out, bias=, shard_sizes=)``
and never sees how they are stored: the selected quantizer's format, or without one
float weights multiplied by the platform's linear method (:class:`Unquantized` or a
subclass: :meth:`~modserve.core.interfaces.Platform.linear_method`). Its LM head comes from
``make_linear.lm_head(hidden, vocab)``: float, by that same method, whatever the quantizer.
After loading, the core calls :func:`finish_linears`: every tensor arrived, then each
quantizer post-processes.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from modserve.core.interfaces import LinearSpec, Quantizer
from modserve.core.plugin_calls import quantized_apply


class Linear(nn.Module):
    """``y = x @ W.T + b``; the quantizer holds W, the layer holds the float bias."""

    def __init__(self, spec: LinearSpec, quantizer: Quantizer) -> None:
        super().__init__()
        if sum(spec.shard_sizes) != spec.out_features:
            raise ValueError(f"shard sizes {spec.shard_sizes} do not add up to {spec.out_features} outputs")
        self.spec = spec
        self.quantizer = quantizer
        self.bias = param(torch.empty(spec.out_features, dtype=spec.dtype)) if spec.bias else None
        quantizer.create_weights(self, spec)
        self.loaded: set[tuple[str, int]] = set()
        self.checked = False  # the quantizer's output shape, checked at the first eager call

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if torch.compiler.is_compiling():  # NOTE: traced code stays free of the checks' branches
            return self.quantizer.apply(self, x)
        return quantized_apply(self, x)

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        """One checkpoint tensor (``name``: its last name part) of output shard ``shard``."""
        if name == "bias" and self.bias is not None:
            load_shard(self.bias, tensor, self.spec, shard, dim=0, name=name)
        else:
            self.quantizer.load_weight(self, name, tensor, shard)
        self.loaded.add((name, shard))

    def missing(self) -> list[str]:
        names = self.quantizer.tensor_names(self.spec) + (("bias",) if self.spec.bias else ())
        shards = range(len(self.spec.shard_sizes))
        return [f"{n} (shard {s})" if len(shards) > 1 else n
                for n in names for s in shards if (n, s) not in self.loaded]

    def planned_bytes(self) -> int:
        bias = self.spec.out_features * self.spec.dtype.itemsize if self.spec.bias else 0
        return self.quantizer.weight_bytes(self.spec) + bias

    def extra_repr(self) -> str:
        s = self.spec
        return f"in={s.in_features}, out={s.out_features}, bias={s.bias}, {type(self.quantizer).__name__}"


class LMHead(nn.Module):
    """The vocabulary projection ``[N, hidden] -> [N, vocab]``: a float ``weight`` (the
    embedding's, when tied) that no quantizer ever owns, multiplied by the platform's
    linear method like every unquantized linear's."""

    def __init__(self, spec: LinearSpec, method: "Unquantized") -> None:
        super().__init__()
        self.spec = spec
        self.quantizer = method  # always a float method
        self.bias = None
        method.create_weights(self, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        return self.quantizer.apply(self, x)


class Unquantized(Quantizer):
    """Float weights ``[out, in]`` in the model dtype: ``F.linear``, exactly ``nn.Linear``.
    The default linear method; a platform's subclass may read copies of the weights that it
    added after loading (the CPU's: a 16-bit ``decode_weight``, a ``packed_weight``)."""

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        layer.weight = param(torch.empty(spec.out_features, spec.in_features, dtype=spec.dtype))

    def load_weight(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int) -> None:
        check_name(self, name, ("weight",))
        load_shard(layer.weight, tensor, layer.spec, shard, dim=0, name=name)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float()

    def weight_bytes(self, spec: LinearSpec) -> int:
        return spec.out_features * spec.in_features * spec.dtype.itemsize


class LinearFactory:
    """The ``make_linear`` a model receives: every projection it makes goes through
    ``quantizer``, or without one through ``float_method`` (the platform's linear method;
    default :class:`Unquantized`), and so does its LM head, quantizer or not."""

    def __init__(self, quantizer: Quantizer | None, dtype: torch.dtype, device: torch.device | str,
                 float_method: Unquantized | None = None) -> None:
        self.float_method = float_method or Unquantized()
        self.quantizer = quantizer or self.float_method
        self.dtype = dtype
        self.device = torch.device(device)

    def __call__(self, in_features: int, out_features: int, *, bias: bool = False,
                 shard_sizes: tuple[int, ...] | None = None) -> Linear:
        spec = LinearSpec(in_features, out_features, tuple(shard_sizes or (out_features,)), bias, self.dtype,
                          self.device)
        return Linear(spec, self.quantizer)

    def lm_head(self, in_features: int, out_features: int) -> LMHead:
        spec = LinearSpec(in_features, out_features, (out_features,), False, self.dtype, self.device)
        return LMHead(spec, self.float_method)


linear_factory = LinearFactory  # the name models and tools have always built it by


def float_layers(model: nn.Module) -> list[nn.Module]:
    """The layers whose float ``weight`` a float method multiplies: every linear that no
    quantizer owns, and the LM head. A platform adds its weight copies to these."""
    return [m for m in model.modules() if isinstance(m, (Linear, LMHead)) and isinstance(m.quantizer, Unquantized)]


def finish_linears(model: nn.Module) -> None:
    """After ``load_weights``: check that every linear got all its tensors, then post-process."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    for name, m in linears:
        if missing := m.missing():
            raise ValueError(f"checkpoint is missing tensors for {name}: {', '.join(missing)}")
    for _, m in linears:
        m.quantizer.process_weights(m)


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (a tied weight once)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def planned_model_bytes(model: nn.Module) -> int:
    """What :func:`model_bytes` will be after loading, from a model built on "meta":
    linears as their quantizer plans them, everything else at its dtype (a tied weight once)."""
    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, Linear):
            total += module.planned_bytes()
            continue
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build a model's float tensors in ``dtype`` (quantized tensors keep theirs)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# -- helpers for quantizers -----------------------------------------------------------
def param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def check_name(quantizer: Quantizer, name: str, known: tuple[str, ...]) -> None:
    if name not in known:
        raise ValueError(f"{type(quantizer).__name__} layers read {', '.join(known)} from the checkpoint, "
                         f"not {name!r}: is the checkpoint quantized differently?")


def load_shard(dst: torch.Tensor, src: torch.Tensor, spec: LinearSpec, shard: int, dim: int,
               name: str, pack: int = 1) -> None:
    """Copy a checkpoint tensor into output shard ``shard`` of ``dst``, whose output
    channels run along ``dim``, ``pack`` of them per element (8 for int4 in int32)."""
    start, size = spec.shard_offset(shard) // pack, spec.shard_sizes[shard] // pack
    part = dst.narrow(dim, start, size)
    if part.shape != src.shape:
        raise ValueError(f"checkpoint tensor {name!r} (shard {shard}) has shape {tuple(src.shape)}, "
                         f"expected {tuple(part.shape)}")
    with torch.no_grad():
        part.copy_(src)
