"""Packed float32 weights for batched CPU GEMMs: panels for the C++ kernel, or oneDNN's.

PyTorch's ``F.linear`` on a CPU calls MKL's sgemm, which repacks the weight on every
call. For the row counts of batched decode that repacking is most of the work: on the
2-core AMD EPYC the reference figures come from, a [4, 768] x [768, 4096] product
took 2.3 ms through ``F.linear`` and 0.7 ms through oneDNN with the weight packed once
at load (``mkldnn._reorder_linear_weight``); at 16 rows 3.2 against 1.9 ms.

Where the C++ kernels build (:mod:`modserve.core.cpu_kernels`), the packed copy is
panels instead: ``[ceil(N / 16), K, 16]``, 16 output features per panel, read by
``modserve_cpu::panel_linear`` (``csrc/bf16_linear.cpp``), which ran 1.15-1.3x oneDNN's
packed GEMM here at every row count from 24 to 2048 (a layer's four linears: 133
against 107 GFLOP/s at 64 rows, 164 against 141 at 512). Elsewhere it is oneDNN's
opaque tensor.

Either copy sits beside the float weight (which ``dequantize``, the batch-1 GEMV and
eager fallbacks still read), so it costs a second float32 copy of every linear;
``prepack_weights: off`` saves that memory. Both sum in a different order from MKL, so
results differ from ``F.linear`` in the last bits: ``auto`` packs only the models
``compile: auto`` would compile (>= 64 MiB), and the small models the tests hold against
transformers keep ``F.linear``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from modserve.core.compile import AUTO_COMPILE_MIN_BYTES, float_weight_modules
from modserve.core.cpu_kernels import bf16_linear_ready

logger = logging.getLogger("modserve")


def prepack_wanted(setting: str, device: torch.device, dtype: torch.dtype, weight_bytes: int,
                   quantized: bool) -> bool:
    """Whether to pack; ``on`` where packing cannot work is an error, ``auto`` logs why not."""
    problem = None
    if device.type != "cpu":
        problem = f"packed weights are for CPU GEMMs, not {device.type}"
    elif dtype != torch.float32:
        problem = f"packed GEMMs are float32; this model computes in {str(dtype).removeprefix('torch.')}"
    elif quantized:
        problem = "a quantizer owns the linears' weights"
    elif not torch.backends.mkldnn.is_available():
        problem = "this torch build has no oneDNN (mkldnn)"
    if setting == "on" and problem:
        raise ValueError(f"prepack_weights: on, but {problem}")
    if setting != "auto":
        return setting == "on"
    if problem is None and weight_bytes < AUTO_COMPILE_MIN_BYTES:
        problem = f"{weight_bytes / 2**20:.0f} MiB of weights, below the {AUTO_COMPILE_MIN_BYTES >> 20} MiB of auto"
    if problem:
        logger.info("prepack_weights auto: off (%s)", problem)
    return problem is None


PANEL = 16  # output features per panel (two 8-float vectors)


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N / 16), K, 16]``: panel ``p`` row ``k`` holds ``W[16p:16p+16, k]``
    (zero rows pad the last panel)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.float32)
    padded[:n] = weight
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def add_packed_weights(model: nn.Module) -> int:
    """Give every :func:`~modserve.core.compile.float_weight_modules` module (linears, the LM
    head) a ``packed_weight`` attribute, panels where the C++ kernel is built, else oneDNN's
    layout (logged); returns the bytes the packed copies take."""
    panels = bf16_linear_ready()
    logger.info("prepack_weights: %s", "float32 panels for the C++ GEMM" if panels else
                "oneDNN's layout (the C++ kernel is not built here)")
    total = 0
    for module in float_weight_modules(model):
        weight = module.weight.detach()
        # A plain attribute, not a buffer: state_dict, .to() and model_bytes know nothing of
        # the packed layouts.
        module.packed_weight = to_panels(weight) if panels else torch.ops.mkldnn._reorder_linear_weight(weight, None)
        total += (module.packed_weight.numel() if panels else weight.numel()) * 4
    return total


@torch.library.custom_op("modserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """``x @ W.T + b`` with ``W`` ([out_features, K]) packed by :func:`add_packed_weights`. An
    opaque op inside compiled regions: inductor lowers oneDNN linears only for weights it
    froze itself, and knows nothing of panels."""
    if packed_weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight, bias, "none", [], "")
    return torch.ops.modserve_cpu.panel_linear(x, packed_weight, out_features, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)
