"""Linear layers whose weights a :class:`~modserve.core.contracts.quantizer.Quantizer` owns.

A model asks for its projections through ``make_linear(in, out, bias=, shard_sizes=)``
and never sees how they are stored: the selected quantizer's format, or without one
float weights multiplied by the platform's linear method (:class:`Unquantized` or a
subclass: :meth:`~modserve.core.contracts.platform.Platform.linear_method`). Its LM head comes from
``make_linear.lm_head(hidden, vocab)``: float, by that same method, whatever the quantizer.
After loading, the core calls :func:`finish_linears`: every tensor arrived, then each
quantizer post-processes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from modserve.core.contracts.quantizer import LinearSpec, Quantizer, TensorLayout
from modserve.core.contracts.moe_backend import MoEBackend
from modserve.core.plugin_calls import broke, described, failed
from modserve.runner.checkpoint import CheckpointTensor, as_tensor
from modserve.runner.parallel import TensorParallel


BIAS_LAYOUT = TensorLayout(out_dim=0, in_dim=None)  # [out]: a row-parallel layer's is whole on every rank


class Linear(nn.Module):
    """``y = x @ W.T + b``; the quantizer holds W, the layer holds the float bias."""

    def __init__(self, spec: LinearSpec, quantizer: Quantizer, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.tp = tp
        if sum(spec.shard_sizes) != spec.out_features:
            raise ValueError(f"shard sizes {spec.shard_sizes} do not add up to {spec.out_features} outputs")
        self.spec = spec
        self.quantizer = quantizer
        self.bias = param(torch.empty(spec.out_features, dtype=spec.dtype)) if spec.bias else None
        quantizer.create_weights(self, spec)
        self.loaded: set[tuple[str, int]] = set()
        self.checked = False  # the quantizer's output shape, checked at the first eager call
        self.lora = None  # a LinearLoRA (runner/lora.py) under enable_lora: its adapters' slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if torch.compiler.is_compiling():  # NOTE: traced code stays free of the checks' branches
            y = self.quantizer.apply(self, x)
        else:
            y = quantized_apply(self, x)
        if self.lora is not None:  # before the all-reduce: a row-parallel rank's update is partial too
            if torch.compiler.is_compiling():  # NOTE: an opaque op; the step's mapping is read eagerly
                torch.ops.modserve.lora_add(y, x, self.lora_index)
            else:
                y = self.lora(y, x)
        return self.tp.all_reduce(y) if self.spec.parallel == "row" else y  # the ranks' partial sums

    def load(self, name: str, tensor: torch.Tensor | CheckpointTensor, shard: int = 0) -> None:
        """One checkpoint tensor (``name``: its last name part) of output shard ``shard``,
        this rank's slice of it under tensor parallelism (of a checkpoint handle, only the
        slice is read)."""
        if name == "bias" and self.bias is not None:
            if self.spec.parallel == "row" and self.tp.rank:  # added once, by rank 0, before the all-reduce
                tensor = torch.zeros(tensor.shape, dtype=tensor.dtype or self.spec.dtype)
            load_shard(self.bias, as_tensor(self._rank_slice(name, tensor, shard, BIAS_LAYOUT)), self.spec, shard,
                       dim=0, name=name)
        else:
            self.quantizer.load_weight(self, name, as_tensor(self._rank_slice(name, tensor, shard)), shard)
        self.loaded.add((name, shard))

    def _rank_slice(self, name: str, tensor: torch.Tensor | CheckpointTensor, shard: int,
                    layout: TensorLayout | None = None) -> torch.Tensor | CheckpointTensor:
        spec = self.spec
        if spec.tp_size == 1 or spec.parallel is None:
            return tensor
        layout = layout or self.quantizer.tensor_layout(name, spec)
        if spec.parallel == "column" and layout.out_dim is not None:
            per = layout.out_per_element
            return tensor.narrow(layout.out_dim, spec.shard_starts[shard] // per, spec.shard_sizes[shard] // per)
        if spec.parallel == "row" and layout.in_dim is not None:
            per = layout.in_per_element
            return tensor.narrow(layout.in_dim, spec.in_start // per, spec.in_features // per)
        return tensor

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
    linear method like every unquantized linear's. Under tensor parallelism each rank holds
    rows ``vocab_start:+out_features`` of the padded vocabulary and the logits are gathered."""

    def __init__(self, spec: LinearSpec, method: "Unquantized", tp: TensorParallel = TensorParallel(),
                 vocab_size: int | None = None) -> None:
        super().__init__()
        self.spec, self.tp = spec, tp
        self.quantizer = method  # always a float method
        self.bias = None
        self.vocab_size = vocab_size or spec.out_features
        self.vocab_start = tp.rank * spec.out_features
        method.create_weights(self, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        y = self.quantizer.apply(self, x)
        return y if self.tp.size == 1 else self.tp.all_gather(y)[:, : self.vocab_size]

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        load_vocab_rows(self.weight, tensor, self.vocab_start, self.vocab_size, name)


class VocabEmbedding(nn.Module):
    """Token ids ``[T]`` to rows ``[T, hidden]``; under tensor parallelism each rank looks
    up the ids in its share of the vocabulary, zeros for the others, and the ranks sum."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        rows = vocab_size if tp.size == 1 else padded_vocab(vocab_size, tp.size) // tp.size
        self.tp, self.vocab_size, self.vocab_start = tp, vocab_size, tp.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(x)

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        load_vocab_rows(self.weight, tensor, self.vocab_start, self.vocab_size, name)


def padded_vocab(vocab_size: int, tp_size: int, multiple: int = 64) -> int:
    """The vocabulary rounded up so every rank holds an equal multiple of 64 rows (vLLM's rule)."""
    step = multiple * tp_size
    return -(-vocab_size // step) * step


def load_vocab_rows(dst: torch.Tensor, src: torch.Tensor | CheckpointTensor, start: int, vocab_size: int,
                    name: str) -> None:
    """Rows ``start:+len(dst)`` of a ``[vocab, hidden]`` checkpoint tensor (only those read);
    padding rows zero."""
    if tuple(src.shape) != (vocab_size, dst.shape[1]):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected "
                         f"{(vocab_size, dst.shape[1])}")
    rows = as_tensor(src[start : start + dst.shape[0]])
    with torch.no_grad():
        dst[: rows.shape[0]].copy_(rows)
        dst[rows.shape[0] :].zero_()


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
                 float_method: Unquantized | None = None, tp: TensorParallel = TensorParallel(),
                 layers: range | None = None, moe_backend: MoEBackend | None = None,
                 expert_parallel: bool = False) -> None:
        self.float_method = float_method or Unquantized()
        self.quantizer = quantizer or self.float_method
        self.dtype = dtype
        self.device = torch.device(device)
        self.tp = tp  # models read tp.size to size their heads
        self.layers = layers  # the decoder layers this pipeline stage builds; None: all
        self.moe_backend = moe_backend  # how a mixture-of-experts layer runs its experts (moe_backend:)
        self.expert_parallel = expert_parallel  # whole experts per rank, not slices of each (enable_expert_parallel)

    def __call__(self, in_features: int, out_features: int, *, bias: bool = False,
                 shard_sizes: tuple[int, ...] | None = None, parallel: str | None = None,
                 shard_replicas: tuple[int, ...] | None = None) -> Linear:
        """``parallel``: ``column`` splits each output shard over the ranks (``shard_replicas[i]``
        ranks holding the same rows of shard i: KV heads fewer than ranks), ``row`` splits the
        inputs and sums the ranks' outputs; None keeps the layer whole on every rank."""
        sizes, tp = tuple(shard_sizes or (out_features,)), self.tp
        if tp.size == 1 or parallel is None:
            spec = LinearSpec(in_features, out_features, sizes, bias, self.dtype, self.device)
        elif parallel == "column":
            parts = [tp.part(size, r) for size, r in zip(sizes, shard_replicas or (1,) * len(sizes))]
            rank_sizes = tuple(size for _, size in parts)
            spec = LinearSpec(in_features, sum(rank_sizes), rank_sizes, bias, self.dtype, self.device, "column",
                              tp.size, tuple(start for start, _ in parts))
        elif parallel == "row":
            start, size = tp.part(in_features)
            spec = LinearSpec(size, out_features, sizes, bias, self.dtype, self.device, "row", tp.size, in_start=start)
        else:
            raise ValueError(f"parallel must be 'column', 'row' or None, not {parallel!r}")
        return Linear(spec, self.quantizer, tp)

    def lm_head(self, in_features: int, out_features: int) -> LMHead:
        rows = out_features if self.tp.size == 1 else padded_vocab(out_features, self.tp.size) // self.tp.size
        spec = LinearSpec(in_features, rows, (rows,), False, self.dtype, self.device)
        return LMHead(spec, self.float_method, self.tp, out_features)

    def embedding(self, vocab_size: int, hidden: int) -> VocabEmbedding:
        return VocabEmbedding(vocab_size, hidden, self.tp)


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


def quantized_apply(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """``layer.quantizer.apply(layer, x)`` run eagerly: what it raises names the quantizer, and
    a layer's first call checks that it gives ``[T, out]``."""
    q = layer.quantizer
    try:  # NOTE: every linear of every layer: a bare try costs nothing, a context manager would
        out = q.apply(layer, x)
    except Exception as e:
        raise failed(q, "quantizer", "apply()", e) from e
    if not layer.checked:
        want = (*x.shape[:-1], layer.spec.out_features)
        if not isinstance(out, torch.Tensor) or out.shape != want:
            raise broke(q, "quantizer", "apply()", f"a tensor of shape {list(want)} ([T, out])", described(out))
        layer.checked = True
    return out
