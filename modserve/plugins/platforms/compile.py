"""torch.compile for a model's regions: the mechanism; each platform decides when.

The ~50 small ops of a layer (norms, RoPE, SiLU, residual adds) cost more in dispatch than
in arithmetic. A model hands its layer to :func:`compiler` (``CausalLM.compile_regions``),
so it becomes one inductor graph; attention inside it is an opaque custom op
(:mod:`modserve.runner.forward_context`), so the backend stays a plugin, called eagerly.

``dynamic=True`` makes one graph for every batch size >= 2; dynamo specializes size 1
by itself, which is the graph that takes a linear method's single-row branch.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

logger = logging.getLogger("modserve")


# Below this many weight bytes the first compile (~10-20 s on two CPU cores, tens of seconds on
# a GPU) costs more than the per-step time it saves over a typical run; the test models are far below.
AUTO_COMPILE_MIN_BYTES = 64 * 2**20


def compiler(fn: Callable) -> Callable:
    """How a platform compiles a model region: one graph for batch size 1, one for the rest."""
    # A layer's index (an int attribute) must be a graph input, not a constant, or every
    # layer would compile its own copy of the same graph.
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    # Every model built in a process adds its graphs to the same code object's cache (two per
    # layer class and linear kind: float, int8, ...); past dynamo's default of 8, the next
    # engine in that process (modserve compare's second side, a test session) would fail.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, dynamic=True, fullgraph=True)


def compile_regions(model: nn.Module) -> bool:
    """Ask the model to compile its regions; False when its architecture has none."""
    compile_regions = getattr(model, "compile_regions", None)
    return bool(compile_regions and compile_regions(compiler))


def compile_wanted(setting: str, weight_bytes: int, quantized: bool, traceable: bool = False) -> bool:
    """The ``compile`` setting: ``auto`` is on for models of AUTO_COMPILE_MIN_BYTES or more,
    unquantized or with a quantizer whose ``apply`` traces (logged when off, saying why).
    Compiled, each layer's elementwise chains (RMSNorm, RoPE, SiLU-and-mul, residual adds) fuse
    into a few kernels around the GEMMs and attention: C++ loops on a CPU, Triton kernels on a GPU."""
    if setting != "auto":
        return setting == "on"
    if quantized and not traceable:
        logger.info("compile auto: off (this quantizer's linears run eagerly; set compile: on to try them compiled)")
        return False
    if weight_bytes < AUTO_COMPILE_MIN_BYTES:
        logger.info("compile auto: off (%.0f MiB of weights: compiling would take longer than it saves)",
                    weight_bytes / 2**20)
        return False
    return True
