"""Packed float32 weights for batched CPU GEMMs: panels for the C++ kernel, or oneDNN's.

PyTorch's ``F.linear`` on a CPU calls MKL's sgemm, which repacks the weight on every
call. For the row counts of batched decode that repacking is most of the work, so the
weight is packed once at load (``mkldnn._reorder_linear_weight``) and oneDNN reads it.

Where the C++ kernels build (:mod:`.kernels`), the packed copy is
panels instead: ``[ceil(N / 16), K, 16]``, 16 output features per panel, read by
``modserve_cpu::panel_linear`` (``csrc/bf16_linear.cpp``), which beats oneDNN's packed
GEMM at every batched row count (docs/benchmarks.md, CPU performance, has the
figures). Elsewhere it is oneDNN's opaque tensor.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from modserve.api import float_layers
from modserve.plugins.platforms.cpu.kernels import bf16_linear_ready

logger = logging.getLogger("modserve")

PANEL = 16  # output features per panel (two 8-float vectors)


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N / 16), K, 16]``: panel ``p`` row ``k`` holds ``W[16p:16p+16, k]``
    (zero rows pad the last panel)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.float32)
    padded[:n] = weight
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def add_packed_weights(model: nn.Module) -> int:
    """Give every :func:`~modserve.runner.linear.float_layers` layer (linears, the LM head) a
    ``packed_weight`` attribute, panels where the C++ kernel is built, else oneDNN's
    layout (logged); returns the bytes the packed copies take.

    Beside panels, a layer with a bfloat16 ``decode_weight`` (the few-rows route) reads its
    float32 weight nowhere: ``few_rows_linear`` takes up to 16 rows from the copy, more from
    the panels. That copy becomes its weight (:func:`_weight_is_decode_copy`) as soon as the
    layer is packed, so no more than one layer holds its float32 weight and panels at once."""
    panels = bf16_linear_ready()
    logger.info("prepack_weights: %s", "float32 panels for the C++ GEMM" if panels else
                "oneDNN's layout (the C++ kernel is not built here)")
    layers = float_layers(model)
    total, narrowed = 0, 0
    for module in layers:
        weight = module.weight.detach()
        # A plain attribute, not a buffer: state_dict, .to() and model_bytes know nothing of
        # the packed layouts.
        module.packed_weight = to_panels(weight) if panels else torch.ops.mkldnn._reorder_linear_weight(weight, None)
        total += (module.packed_weight.numel() if panels else weight.numel()) * 4
        if panels:
            narrowed += _weight_is_decode_copy(module)
    if narrowed:
        logger.info("prepack_weights: %d of %d layers hold their weight as their bf16 decode copy beside the "
                    "panels, no plain float32 one", narrowed, len(layers))
    return total


def _weight_is_decode_copy(module: nn.Module) -> bool:
    """Make a layer's bfloat16 ``decode_weight`` its weight as well (one storage; exact, the
    checkpoint being bf16), dropping the float32 one; False where it has no such copy.

    NOTE: a head tied to the embedding is untied by this at no cost: the embedding keeps its
    float32 rows, which it reads, and the head reads its copy and panels."""
    decode = getattr(module, "decode_weight", None)
    if decode is None or decode.dtype != torch.bfloat16:
        return False
    module.weight = nn.Parameter(decode, requires_grad=False)  # a new tensor on decode's storage
    return True


# The row count oneDNN lays a bf16 weight out for: decode batches, which the packed copy
# serves (bf16_gemm_linear reads it up to 256 rows).
BF16_PACK_ROWS = 64


def add_bf16_packed_weights(model: nn.Module) -> int:
    """Give every :func:`~modserve.runner.linear.float_layers` layer whose weight is bf16 (the
    ``bf16_gemm`` route) a ``packed_weight`` that a GEMM of a decode batch reads without
    reordering the weight on every call: the AMX tiles' own layout where the CPU has AMX-BF16
    (``modserve_cpu::pack_tiles``; ``bf16_gemm_linear`` multiplies it by oneDNN's brgemm
    ukernel, a single row by a ``vdpbf16ps`` loop), else oneDNN's blocked layout. Returns its
    bytes."""
    tiles = bool(torch.ops.modserve_cpu.tiles_ready())
    total = 0
    for module in float_layers(model):
        if module.weight.dtype == torch.bfloat16:
            weight = module.weight.detach()
            if tiles and weight.shape[1] % 2 == 0:
                module.packed_weight = torch.ops.modserve_cpu.pack_tiles(weight)
            else:
                module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, BF16_PACK_ROWS)
            total += module.weight.numel() * 2
    logger.info("prepack_weights: bf16 weights in %s for decode batches (%.0f MiB)",
                "the AMX tiles' layout" if tiles else "oneDNN's layout", total / 2**20)
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
