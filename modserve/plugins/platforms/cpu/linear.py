"""The CPU platform's linear method: float weights read by the cheapest route a step has.

A decode step of a few sequences on a CPU is bound by memory bandwidth: every weight is
read once per token. A bfloat16 checkpoint's weights are exact in bfloat16, and
:mod:`.features` picks, per CPU, one of two routes for them (``dtype: auto``):

- ``bf16_gemm`` (CPUs with AMX): the weights are kept in bfloat16 only and every linear
  runs oneDNN's bf16 GEMM (``modserve_cpu::bf16_gemm_linear``): input rounded to bf16,
  float32 accumulation, on AMX tiles, from a copy packed once at load for decode batches
  (:mod:`.prepack`), a dot kernel for one to three rows. It reads half the bytes at every row count and
  computes prefill many times faster than float32; the model's other work (norms,
  attention, residual stream) stays float32.
- ``few_rows`` (elsewhere): up to 16 rows, a C++ kernel (``csrc/bf16_linear.cpp``,
  ``modserve_cpu::few_rows_linear``) reads a 16-bit copy once per 8 rows and accumulates
  float32 inputs exactly (in 16-float vectors on AVX-512 CPUs without AVX512-BF16:
  :meth:`.features.CpuFeatures.few_rows_floats`); prefill and larger batches multiply float32
  weights: panels packed once at load where :mod:`.prepack` says so (the layer's weight is then
  the bf16 copy, no plain float32 one kept), else the plain weight. Where the kernel cannot be
  built, or for a float16 copy, a compiled GEMV does the same for a single row.

Which copies a layer holds is decided once, after loading (:class:`.platform.CpuPlatform`);
:meth:`CpuLinear.apply` only reads what is there.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from modserve.api import Unquantized, float_layers, model_bytes
from modserve.plugins.platforms.cpu.features import CpuFeatures, cpu_features
from modserve.plugins.platforms.cpu.kernels import bf16_linear_ready

logger = logging.getLogger("modserve")

# Whether torch.ops.modserve_cpu.few_rows_linear and .bf16_gemm_linear are loaded (with
# their fakes): set where the route is chosen, a plain global so compiled regions read it
# as a constant.
_bf16_kernel = False

# Most rows the bf16 kernel takes (in passes of up to 8); beyond, float32 GEMMs win.
FEW_ROWS = 16


class CpuLinear(Unquantized):
    """Float weights ``[out, in]``, multiplied by :func:`linear_or_gemv` from the copies the
    platform gave the layer after loading (a 16-bit ``decode_weight``, a ``packed_weight``),
    else exactly ``F.linear``."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return linear_or_gemv(x, layer.weight, layer.bias, getattr(layer, "decode_weight", None),
                              getattr(layer, "packed_weight", None))

    def native_op(self, layer: nn.Module) -> tuple[str, list[torch.Tensor | None]] | None:
        decode_weight = getattr(layer, "decode_weight", None)
        if decode_weight is not None and decode_weight.dtype == torch.bfloat16 and _bf16_kernel:
            return "modserve_cpu::few_rows_linear", [layer.weight, decode_weight, getattr(layer, "packed_weight", None),
                                                      layer.bias]
        if decode_weight is None and layer.weight.dtype == torch.bfloat16 and _bf16_kernel:
            return "modserve_cpu::bf16_gemm_linear", [layer.weight, getattr(layer, "packed_weight", None), layer.bias]
        return None


def linear_or_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   decode_weight: torch.Tensor | None, packed_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, by the fastest route the layer has: with bfloat16
    weights under float32 input (the ``bf16_gemm`` route), oneDNN's bf16 GEMM; with a bfloat16
    ``decode_weight`` ([out, in]) and the kernel built, ``modserve_cpu::few_rows_linear``
    (up to :data:`FEW_ROWS` rows from the bf16 copy, more in float32); for one
    row inside a compiled region, the 16-bit ``decode_weight`` as one fused
    upcast-multiply-sum over ``in``; with a ``packed_weight`` (:mod:`.prepack`:
    panels or oneDNN's layout), the GEMM for that layout.

    NOTE: a layer with a ``decode_weight`` takes the few-rows route whatever its weight's
    dtype: beside panels its weight is that bf16 copy itself (:func:`.prepack.add_packed_weights`)."""
    if decode_weight is not None and decode_weight.dtype == torch.bfloat16 and _bf16_kernel:
        return torch.ops.modserve_cpu.few_rows_linear(x, weight, decode_weight, packed_weight, bias)
    if decode_weight is None and weight.dtype == torch.bfloat16 and x.dtype == torch.float32:
        if _bf16_kernel and torch.compiler.is_compiling():
            # the casts stay in the graph, where inductor fuses them into the norm, activation
            # or residual add beside the GEMM: no float32 copy of an activation for the GEMM alone
            y = torch.ops.modserve_cpu.bf16_gemm(x.to(torch.bfloat16), weight, packed_weight).float()
            return y if bias is None else y + bias
        if _bf16_kernel:
            return torch.ops.modserve_cpu.bf16_gemm_linear(x, weight, packed_weight, bias)
        y = F.linear(x.to(torch.bfloat16), weight).float()
        return y if bias is None else y + bias
    if decode_weight is not None and x.shape[0] == 1 and torch.compiler.is_compiling():
        y = (x.unsqueeze(1) * decode_weight.to(x.dtype)).sum(-1)  # [1, out], float32 accumulation
        return y if bias is None else y + bias
    if packed_weight is not None:
        return torch.ops.modserve.packed_linear(x, packed_weight, bias, weight.shape[0])
    return F.linear(x, weight, bias)


def bf16_gemm_wanted(setting: str, features: CpuFeatures, dtype_setting: str, compute: torch.dtype,
                     checkpoint: torch.dtype) -> bool:
    """Whether the float linears take the ``bf16_gemm`` route (``setting``: auto, on, off;
    auto: :meth:`CpuFeatures.default_route`); ``on`` where it cannot apply is an error. Logs
    the choice with the CPU it was made for."""
    problem = _bf16_gemm_problem(dtype_setting, compute, checkpoint)
    if setting == "on" and problem:
        raise ValueError(f"platform option bf16_gemm: on, but {problem}")
    wanted = bf16_gemm_applies(setting, features, dtype_setting, compute, checkpoint)
    if wanted:
        global _bf16_kernel
        _bf16_kernel = load_few_rows_kernel()
        logger.info("dtype auto on %s: linears read the checkpoint's bfloat16 weights through oneDNN's bf16 "
                    "GEMM (inputs rounded to bf16, float32 accumulation; bf16_gemm %s); norms, attention and "
                    "the residual stream in float32, the KV cache in bf16 (kv_cache_dtype auto); dtype float32 "
                    "keeps every product exact", features.describe(),
                    setting)
    elif problem is None and checkpoint == torch.bfloat16:
        logger.info("dtype auto on %s: bf16_gemm %s: float32 GEMMs, bf16 weights for few-row decode",
                    features.describe(), setting)
    return wanted


def bf16_gemm_applies(setting: str, features: CpuFeatures, dtype_setting: str, compute: torch.dtype,
                      checkpoint: torch.dtype) -> bool:
    """Whether the ``bf16_gemm`` route applies (:func:`bf16_gemm_wanted`, without its log)."""
    if _bf16_gemm_problem(dtype_setting, compute, checkpoint) is not None:
        return False
    return setting == "on" or (setting == "auto" and features.default_route() == "bf16_gemm")


def _bf16_gemm_problem(dtype_setting: str, compute: torch.dtype, checkpoint: torch.dtype) -> str | None:
    if checkpoint != torch.bfloat16:
        return f"the checkpoint is {str(checkpoint).removeprefix('torch.')}, not bfloat16"
    if dtype_setting != "auto" or compute != torch.float32:
        return f"dtype {dtype_setting} asks for {str(compute).removeprefix('torch.')} linears"
    return None


def to_bf16_weights(model: nn.Module) -> int:
    """Replace every :func:`~modserve.runner.linear.float_layers` layer's float32 weight by
    its bfloat16 value (exact for a bf16 checkpoint), except a head tied to the embedding,
    which keeps the embedding's float32 rows; returns the bytes a decode step then reads."""
    targets = float_layers(model)
    target_ids = {id(m) for m in targets}
    elsewhere = {id(p) for m in model.modules() if id(m) not in target_ids for p in m.parameters(recurse=False)}
    for module in targets:
        if id(module.weight) in elsewhere:
            logger.info("bf16_gemm: %s is tied to the embedding and stays float32", type(module).__name__)
            continue
        module.weight = nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)
    return model_bytes(model)


def decode_weight_dtype(dtype_setting: str, compute: torch.dtype, checkpoint: torch.dtype,
                        compiled: bool) -> torch.dtype | None:
    """The 16-bit dtype batch-1 decode reads weights in, or None (the compute dtype); logs why."""
    if dtype_setting != "auto" or compute != torch.float32:
        return None
    if checkpoint not in (torch.bfloat16, torch.float16):
        logger.info("dtype auto: decode reads float32 weights (a 16-bit copy of this %s checkpoint "
                    "would round it)", str(checkpoint).removeprefix("torch."))
        return None
    if not compiled:
        logger.info("dtype auto: decode reads float32 weights (the 16-bit decode weights need compile on)")
        return None
    global _bf16_kernel
    if checkpoint == torch.bfloat16:
        _bf16_kernel = load_few_rows_kernel()  # cached: the same answer for every model
    rows = "steps of up to 16 sequences read" if checkpoint == torch.bfloat16 and _bf16_kernel \
        else "single-sequence decode reads"
    width = f" ({set_few_rows_floats(cpu_features())}-float vectors)" if rows.startswith("steps") else ""
    logger.info("dtype auto: prefill and larger batches in float32; %s the checkpoint's %s weights "
                "(half the bytes) and accumulate in float32%s", rows, str(checkpoint).removeprefix("torch."), width)
    return checkpoint


def add_decode_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Give every :func:`~modserve.runner.linear.float_layers` layer (the LM head among them) a
    ``decode_weight`` buffer in ``dtype``; returns the bytes batch-1 decode then reads (a
    quantized linear's own weights count as they are)."""
    targets = float_layers(model)
    for module in targets:
        module.register_buffer("decode_weight", module.weight.detach().to(dtype), persistent=False)
    copied = {id(m.weight) for m in targets}
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if id(t) not in copied}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _few_rows_linear_fake(x: torch.Tensor, weight: torch.Tensor, decode_weight: torch.Tensor,
                          packed_weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _bf16_gemm_linear_fake(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                           bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _bf16_gemm_fake(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])  # bf16, as x


@functools.cache
def load_few_rows_kernel() -> bool:
    """Load the C++ kernel and give ``modserve_cpu::few_rows_linear`` (up to :data:`FEW_ROWS`
    rows: bf16 weights; more: float32) the shape function compiled regions trace it with."""
    if not bf16_linear_ready():
        return False
    torch.library.register_fake("modserve_cpu::few_rows_linear")(_few_rows_linear_fake)
    torch.library.register_fake("modserve_cpu::bf16_gemm_linear")(_bf16_gemm_linear_fake)
    torch.library.register_fake("modserve_cpu::bf16_gemm")(_bf16_gemm_fake)
    set_few_rows_floats(cpu_features())
    return True


def set_few_rows_floats(features: CpuFeatures) -> int:
    """Set the few-rows kernel's vector width for ``features`` (:meth:`CpuFeatures.few_rows_floats`;
    8 where the kernel was built without AVX-512) and return it. Process-wide, like the
    route: the kernel is loaded once per process."""
    floats = features.few_rows_floats() if torch.ops.modserve_cpu.few_rows_avx512_built() else 8
    torch.ops.modserve_cpu.set_few_rows_floats(floats)
    return floats
