"""torch.compile for the ops around attention, and the 16-bit weights of few-row steps.

A decode step of a few sequences on a CPU is bound by memory bandwidth: every weight is
read once per token. Two things make it cheaper:

- The ~50 small ops of a layer (norms, RoPE, SiLU, residual adds) cost more in
  dispatch than in arithmetic. A model hands its layer to :func:`compiler`
  (``CausalLM.compile_regions``), so it becomes one inductor graph; attention inside
  it is an opaque custom op (:mod:`modserve.core.forward_context`), so the backend
  stays a plugin, called eagerly.
- A bfloat16 checkpoint's weights are exact in bfloat16. For up to 16 rows, a C++
  kernel (``csrc/bf16_linear.cpp``, ``modserve_cpu::few_rows_linear``) reads that 16-bit copy
  once per 8 rows and accumulates in float32: half the bytes of float32 weights, with
  float32 results, which a plain bf16 matmul (bf16 output, 6-300x slower GEMMs here)
  does not give. Where the kernel cannot be built, or for a float16 copy, a compiled
  GEMV does the same for a single row. Prefill and larger batches keep float32 weights
  and GEMMs.

``dynamic=True`` makes one graph for every batch size >= 2; dynamo specializes size 1
by itself, which is the graph that takes the GEMV branch.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from modserve.core.cpu_kernels import bf16_linear_ready

logger = logging.getLogger("modserve")

# Below this many weight bytes the first compile (~10-20 s on two cores) costs more
# than the per-step time it saves over a typical run; the test models are far below.
AUTO_COMPILE_MIN_BYTES = 64 * 2**20


def compile_wanted(setting: str, device: torch.device, weight_bytes: int, quantized: bool) -> bool:
    if setting != "auto":
        return setting == "on"
    if quantized:
        logger.info("compile auto: off (quantized linears run eagerly; set compile: on to try them compiled)")
        return False
    if device.type != "cpu":
        logger.info("compile auto: off (on %s the eager path is used; set compile: on to try it)", device.type)
        return False
    if weight_bytes < AUTO_COMPILE_MIN_BYTES:
        logger.info("compile auto: off (%.0f MiB of weights: compiling would take longer than it saves)",
                    weight_bytes / 2**20)
        return False
    return True


def compiler(fn: Callable) -> Callable:
    """How the core compiles a model region: one graph for batch size 1, one for the rest."""
    # A layer's index (an int attribute) must be a graph input, not a constant, or every
    # layer would compile its own copy of the same graph.
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    return torch.compile(fn, dynamic=True, fullgraph=True)


def decode_weight_dtype(dtype_setting: str, compute: torch.dtype, checkpoint: torch.dtype,
                        device: torch.device, compiled: bool) -> torch.dtype | None:
    """The 16-bit dtype batch-1 decode reads weights in, or None (the compute dtype); logs why."""
    if dtype_setting != "auto" or device.type != "cpu" or compute != torch.float32:
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


# Whether torch.ops.modserve_cpu.few_rows_linear is loaded (with its fake): set where decode
# weights are chosen, a plain global so compiled regions read it as a constant.
_bf16_kernel = False

# Most rows the bf16 kernel takes (in passes of up to 8); beyond, float32 GEMMs win.
FEW_ROWS = 16


def linear_or_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   decode_weight: torch.Tensor | None, packed_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, by the fastest route the layer has: with a bfloat16
    ``decode_weight`` ([out, in]) and the kernel built, ``modserve_cpu::few_rows_linear``
    (up to :data:`FEW_ROWS` rows from the bf16 copy, more in float32); for one
    row inside a compiled region, the 16-bit ``decode_weight`` as one fused
    upcast-multiply-sum over ``in``; with a ``packed_weight`` (:mod:`modserve.core.prepack`:
    panels or oneDNN's layout), the GEMM for that layout."""
    if decode_weight is not None and decode_weight.dtype == torch.bfloat16 and _bf16_kernel:
        return torch.ops.modserve_cpu.few_rows_linear(x, weight, decode_weight, packed_weight, bias)
    if decode_weight is not None and x.shape[0] == 1 and torch.compiler.is_compiling():
        y = (x.unsqueeze(1) * decode_weight.to(x.dtype)).sum(-1)  # [1, out], float32 accumulation
        return y if bias is None else y + bias
    if packed_weight is not None:
        return torch.ops.modserve.packed_linear(x, packed_weight, bias, weight.shape[0])
    return F.linear(x, weight, bias)


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


def float_weight_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose float ``weight`` a 16-bit or packed copy may stand in for: every
    unquantized linear, and the model's ``decode_weight_modules`` (the LM head)."""
    from modserve.core.linear import Linear, Unquantized

    linears = [m for m in model.modules() if isinstance(m, Linear) and isinstance(m.quantizer, Unquantized)]
    return linears + model.decode_weight_modules()


def add_decode_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Give every :func:`float_weight_modules` module a ``decode_weight`` buffer in ``dtype``;
    returns the bytes batch-1 decode then reads (a quantized linear's own weights count as
    they are)."""
    targets = float_weight_modules(model)
    for module in targets:
        module.register_buffer("decode_weight", module.weight.detach().to(dtype), persistent=False)
    copied = {id(m.weight) for m in targets}
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if id(t) not in copied}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def checkpoint_dtype(hf_config: Any) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def regions_compiled(model: Any) -> bool:
    """Ask the model to compile its regions; False when its architecture has none."""
    compile_regions = getattr(model, "compile_regions", None)
    return bool(compile_regions and compile_regions(compiler))
