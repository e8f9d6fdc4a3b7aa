"""oneDNN-prepacked float32 weights for batched CPU GEMMs.

PyTorch's ``F.linear`` on a CPU calls MKL's sgemm, which repacks the weight on every
call. For the row counts of batched decode that repacking is most of the work: on the
2-core AMD EPYC the reference figures come from, a [4, 768] x [768, 4096] product
took 2.3 ms through ``F.linear`` and 0.7 ms through oneDNN with the weight packed once
at load (``mkldnn._reorder_linear_weight``); at 16 rows 3.2 against 1.9 ms; from ~512
rows both run at the same ~130 GFLOP/s. The reference workload ran 1.17x faster
end to end.

The packed copy is an opaque oneDNN tensor kept beside the float weight (which
``dequantize``, the batch-1 GEMV and eager fallbacks still read), so it costs a second
float32 copy of every linear; ``prepack_weights: off`` saves that memory. oneDNN sums in
a different order from MKL, so results differ from ``F.linear`` in the last bits:
``auto`` packs only the models ``compile: auto`` would compile (>= 64 MiB), and the
small models the tests hold against transformers keep ``F.linear``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from modserve.core.compile import AUTO_COMPILE_MIN_BYTES, float_weight_modules

logger = logging.getLogger("modserve")


def prepack_wanted(setting: str, device: torch.device, dtype: torch.dtype, weight_bytes: int,
                   quantized: bool) -> bool:
    """Whether to pack; ``on`` where packing cannot work is an error, ``auto`` logs why not."""
    problem = None
    if device.type != "cpu":
        problem = f"oneDNN packing is for CPU weights, not {device.type}"
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


def add_packed_weights(model: nn.Module) -> int:
    """Give every :func:`~modserve.core.compile.float_weight_modules` module (linears, the LM
    head) a ``packed_weight`` attribute; returns the bytes the packed copies take."""
    total = 0
    for module in float_weight_modules(model):
        # A plain attribute, not a buffer: state_dict, .to() and model_bytes know nothing of
        # oneDNN's opaque layout.
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
        total += module.weight.numel() * module.weight.element_size()
    return total


@torch.library.custom_op("modserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` with ``W`` packed by :func:`add_packed_weights`. An opaque op inside
    compiled regions: inductor lowers oneDNN linears only for weights it froze itself."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed_weight.shape[0])
