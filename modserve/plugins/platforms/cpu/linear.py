"""The CPU platform's linear method: float weights read by the cheapest route a step has.

A decode step of a few sequences on a CPU is bound by memory bandwidth: every weight is
read once per token. A bfloat16 checkpoint's weights are exact in bfloat16, so for up to
16 rows a C++ kernel (``csrc/bf16_linear.cpp``, ``modserve_cpu::few_rows_linear``) reads
a 16-bit copy once per 8 rows and accumulates in float32: half the bytes of float32
weights, with float32 results, which a plain bf16 matmul (bf16 output, 6-300x slower
GEMMs here) does not give. Where the kernel cannot be built, or for a float16 copy, a
compiled GEMV does the same for a single row. Prefill and larger batches keep float32
weights and GEMMs (packed once at load where :mod:`.prepack` says so).

Which copies a layer holds is decided once, after loading (:class:`.platform.CpuPlatform`);
:meth:`CpuLinear.apply` only reads what is there.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from modserve.api import Unquantized, float_layers
from modserve.plugins.platforms.cpu.kernels import bf16_linear_ready

logger = logging.getLogger("modserve")

# Whether torch.ops.modserve_cpu.few_rows_linear is loaded (with its fake): set where decode
# weights are chosen, a plain global so compiled regions read it as a constant.
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
        if decode_weight is None or decode_weight.dtype != torch.bfloat16 or not _bf16_kernel:
            return None
        return "modserve_cpu::few_rows_linear", [layer.weight, decode_weight, getattr(layer, "packed_weight", None),
                                                  layer.bias]


def linear_or_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   decode_weight: torch.Tensor | None, packed_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, by the fastest route the layer has: with a bfloat16
    ``decode_weight`` ([out, in]) and the kernel built, ``modserve_cpu::few_rows_linear``
    (up to :data:`FEW_ROWS` rows from the bf16 copy, more in float32); for one
    row inside a compiled region, the 16-bit ``decode_weight`` as one fused
    upcast-multiply-sum over ``in``; with a ``packed_weight`` (:mod:`.prepack`:
    panels or oneDNN's layout), the GEMM for that layout."""
    if decode_weight is not None and decode_weight.dtype == torch.bfloat16 and _bf16_kernel:
        return torch.ops.modserve_cpu.few_rows_linear(x, weight, decode_weight, packed_weight, bias)
    if decode_weight is not None and x.shape[0] == 1 and torch.compiler.is_compiling():
        y = (x.unsqueeze(1) * decode_weight.to(x.dtype)).sum(-1)  # [1, out], float32 accumulation
        return y if bias is None else y + bias
    if packed_weight is not None:
        return torch.ops.modserve.packed_linear(x, packed_weight, bias, weight.shape[0])
    return F.linear(x, weight, bias)


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
    logger.info("dtype auto: prefill and larger batches in float32; %s the checkpoint's %s weights "
                "(half the bytes) and accumulate in float32", rows, str(checkpoint).removeprefix("torch."))
    return checkpoint


def add_decode_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Give every :func:`~modserve.core.linear.float_layers` layer (the LM head among them) a
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


@functools.cache
def load_few_rows_kernel() -> bool:
    """Load the C++ kernel and give ``modserve_cpu::few_rows_linear`` (up to :data:`FEW_ROWS`
    rows: bf16 weights; more: float32) the shape function compiled regions trace it with."""
    if not bf16_linear_ready():
        return False
    torch.library.register_fake("modserve_cpu::few_rows_linear")(_few_rows_linear_fake)
    return True
