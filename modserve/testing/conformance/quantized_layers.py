"""Linear layers for the quantizer kit: checkpoint tensors for each shard, loaded through the core's
:class:`~modserve.api.Linear` as a model's ``load_weights`` would.

A quantizer that quantizes a float checkpoint at load gets float weights. One that reads
pre-quantized checkpoints gets them in the format its ``checkpoint_methods`` name, if the kit
knows how to write it (AWQ GEMM and GPTQ, packed by :mod:`modserve.testing`, which is written
independently of any quantizer); with them comes the reference dequantization.

Under tensor parallelism (:data:`TP_LAYERS`), the same checkpoint tensors load into a whole
layer and into each rank's shard of it, the core slicing them as the quantizer's
``tensor_layout`` says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from modserve.api import Linear, LinearFactory, LinearSpec, Quantizer, TensorParallel
from modserve.testing import AWQ_PACK_ORDER, awq_quantize, gptq_quantize, pack_int32

IN_FEATURES, GROUP = 64, 32
FUSED = (16, 16, 16)  # a fused q/k/v layer's output shards (multiples of 8: int4 packs 8 per int32)
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Shard:
    tensors: dict[str, torch.Tensor]  # checkpoint name -> tensor
    reference: torch.Tensor | None  # [rows, in] float32: the exact dequantization; None: a float checkpoint


def awq_shard(w: torch.Tensor) -> Shard:  # w [rows, in]
    q, zeros, scales = awq_quantize(w, GROUP)  # [K, N], [K/g, N], [K/g, N]
    ref = (q - zeros.repeat_interleave(GROUP, 0)).float() * scales.float().repeat_interleave(GROUP, 0)  # [K, N]
    return Shard({"qweight": pack_int32(q, 4, dim=1, order=AWQ_PACK_ORDER),
                  "qzeros": pack_int32(zeros, 4, dim=1, order=AWQ_PACK_ORDER), "scales": scales}, ref.t())


def gptq_shard(w: torch.Tensor) -> Shard:  # w [rows, in]; 4 bits, groups in order, v1 format (zeros - 1)
    g_idx = torch.arange(w.shape[1], dtype=torch.int32) // GROUP
    q, zeros, scales = gptq_quantize(w, 4, GROUP, g_idx)  # [K, N], [groups, N], [groups, N]
    ref = (q - zeros[g_idx.long()]).float() * scales.float()[g_idx.long()]  # [K, N]
    return Shard({"qweight": pack_int32(q, 4, dim=0), "qzeros": pack_int32(zeros - 1, 4, dim=1), "scales": scales,
                  "g_idx": g_idx}, ref.t())


# checkpoint quant_method -> (its quantization_config, how one shard is written)
FORMATS: dict[str, tuple[dict[str, Any], Callable[[torch.Tensor], Shard]]] = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}, awq_shard),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq"}, gptq_shard),
}


def checkpoint_format(quantizer_cls: type[Quantizer]) -> str | None:
    """The pre-quantized format the kit writes for this quantizer: None for a float checkpoint;
    raises LookupError when it reads only formats the kit cannot write."""
    methods = tuple(quantizer_cls.checkpoint_methods)
    if not methods:
        return None
    known = [m for m in methods if m in FORMATS]
    if not known:
        raise LookupError(f"it reads {', '.join(methods)} checkpoints; the kit writes only {', '.join(FORMATS)}")
    return known[0]


def shard(fmt: str | None, w: torch.Tensor, dtype: torch.dtype) -> Shard:
    return Shard({"weight": w.to(dtype)}, None) if fmt is None else FORMATS[fmt][1](w)


@dataclass
class Layer:
    linear: Linear
    weight: torch.Tensor  # [out, in] float32: the float weight the checkpoint was made from
    reference: torch.Tensor | None  # [out, in] float32: the exact dequantization, for pre-quantized formats


def build(quantizer: Quantizer, fmt: str | None, shard_sizes: tuple[int, ...], order: list[int], bias: bool,
          dtype: torch.dtype, seed: int = 0) -> Layer:
    """A loaded, processed layer of ``IN_FEATURES`` inputs, its shards loaded in ``order``."""
    gen = torch.Generator().manual_seed(seed)
    out = sum(shard_sizes)
    spec = LinearSpec(IN_FEATURES, out, shard_sizes, bias, dtype, CPU)
    w = torch.randn(out, IN_FEATURES, generator=gen) * 0.1  # [out, in]
    b = torch.randn(out, generator=gen).to(dtype)
    layer = Linear(spec, quantizer)
    refs: list[torch.Tensor | None] = [None] * len(shard_sizes)
    for i in order:
        rows = slice(spec.shard_offset(i), spec.shard_offset(i) + shard_sizes[i])
        part = shard(fmt, w[rows], dtype)
        for name, tensor in part.tensors.items():
            layer.load(name, tensor, i)
        if bias:
            layer.load("bias", b[rows], i)
        refs[i] = part.reference
    if missing := layer.missing():  # what the checkpoint format lacks: the kit cannot load it
        raise LookupError(f"its layers read {', '.join(missing)}, which a {fmt or 'float'} checkpoint "
                          f"of the kit does not hold")
    quantizer.process_weights(layer)
    reference = None if fmt is None else torch.cat(refs)  # type: ignore[arg-type]
    weight = w.to(dtype).float() if fmt is None else w
    return Layer(layer, weight, reference)


def kept_bytes(layer: Linear) -> int:
    """Bytes of every tensor the layer keeps besides its bias (the core's)."""
    tensors = [t for name, t in (*layer.named_parameters(), *layer.named_buffers()) if name != "bias"]
    return sum(t.numel() * t.element_size() for t in tensors)


# -- tensor parallelism: a layer's shards on the ranks of two ----------------------------------
TP = 2
# The tiny Llama's projections, MQA (1 KV head of 16, replicated on both ranks): name ->
# (in, output shard sizes, parallel, shard replicas at TP=2).
TP_LAYERS: dict[str, tuple[int, tuple[int, ...], str, tuple[int, ...] | None]] = {
    "qkv_proj": (64, (64, 16, 16), "column", (1, 2, 2)),
    "gate_up_proj": (64, (128, 128), "column", (1, 1)),
    "o_proj": (64, (64,), "row", None),
    "down_proj": (128, (64,), "row", None),
}


def rank_rows(shard_sizes: tuple[int, ...], replicas: tuple[int, ...] | None, tp: TensorParallel) -> torch.Tensor:
    """The whole layer's output rows that rank ``tp.rank`` of a column-parallel layer holds, in its order."""
    rows, offset = [], 0
    for size, r in zip(shard_sizes, replicas or (1,) * len(shard_sizes)):
        start, n = tp.part(size, r)
        rows.append(torch.arange(offset + start, offset + start + n))
        offset += size
    return torch.cat(rows)


def parallel_linear(quantizer: Quantizer, layer: str, tp: TensorParallel,
                    shards: list[dict[str, torch.Tensor]], dtype: torch.dtype = torch.float32) -> Linear:
    """``layer`` of :data:`TP_LAYERS` as rank ``tp.rank`` of ``tp.size`` builds it (``TensorParallel(rank,
    size)`` without a group: only the core's slicing, by ``tensor_layout``, runs), loaded from the
    whole checkpoint tensors of each shard and processed; ``TensorParallel()``: the whole layer."""
    k, sizes, parallel, replicas = TP_LAYERS[layer]
    make = LinearFactory(quantizer, dtype, CPU, tp=tp)
    linear = make(k, sum(sizes), shard_sizes=sizes, parallel=parallel, shard_replicas=replicas)
    for i, tensors in enumerate(shards):
        for name, tensor in tensors.items():
            linear.load(name, tensor, i)
    if missing := linear.missing():
        raise LookupError(f"its layers read {', '.join(missing)}, which the kit's checkpoint does not hold")
    quantizer.process_weights(linear)
    return linear


def float_linear(quantizer: Quantizer, weights: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> Linear:
    """An unsharded layer of these float shard weights (``[rows, in]`` each), loaded and processed:
    what the quantizer makes of exactly that float weight."""
    sizes = tuple(w.shape[0] for w in weights)
    linear = Linear(LinearSpec(weights[0].shape[1], sum(sizes), sizes, False, dtype, CPU), quantizer)
    for i, w in enumerate(weights):
        linear.load("weight", w.to(dtype), i)
    quantizer.process_weights(linear)
    return linear
