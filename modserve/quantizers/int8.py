"""int8: weight-only, one symmetric scale per output channel, quantized from a float checkpoint at load.

    s[n] = max_k |W[n, k]| / 127        q[n, k] = round(W[n, k] / s[n])  in [-127, 127]
    W ≈ q * s[:, None]

Each output row has its own scale, so a fused layer's shards quantize independently as
they arrive: no float copy of the model is ever held.

Under tensor parallelism the default ``[out, in]`` layout applies: a column-parallel rank
quantizes whole rows (TP=1's int8 weights exactly), a row-parallel one its share of each
row's inputs, with scales of its own (finer, so the logits differ from TP=1's by int8 rounding).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from torch import nn

from modserve.api import LinearSpec, Quantizer, check_name, load_shard, param
from modserve.api.cpp import load_kernel
from modserve.quantizers.packing import Workspace

KERNEL = Path(__file__).parent / "csrc" / "int8_linear.cpp"
logger = logging.getLogger("modserve")


class Int8Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # cpu: a C++ op (csrc/int8_linear.cpp) for float32 on a CPU: up to 16 rows read the int8
    # weights once per 8 rows (half the bytes of bf16 for decode), a few weight rows side by
    # side with AVX-512, AVX2 or plain vector code, whichever the build has; more rows take
    # the same passes over blocks of weight rows that stay in cache.
    # int8pack: torch's _weight_int8pack_mm; dequant: int8 -> float, then a float GEMM.
    # auto: cpu where it applies and builds, else dequant. NOTE: torch 2.13's CPU
    # _weight_int8pack_mm costs time linear in the rows even on AVX-512 (a [T, 768] x [768, 2048]
    # product, 1 thread: 1.7 ms at T=1, 100 ms at 64, against 0.25 and 3.1 ms for dequant), so it
    # runs only when named.
    kernel: Literal["auto", "cpu", "int8pack", "dequant"] = "auto"
    # What x becomes in steps of more than 16 rows (prefill, large batches); decode steps of up
    # to 16 rows, bound by reading the weights, always keep float32 activations.
    # float32: weight-only (W8A16), x stays float32. bf16 (kernel cpu, a CPU with AMX-BF16):
    # x rounded to bf16, the int8 weights widened to bf16 (exactly) and multiplied on the AMX
    # tiles into float32 sums. int8 (W8A8, kernel cpu): each row of x quantized to int8
    # (absmax / 127, vLLM's dynamic per-token scheme), multiplied int8 by int8 (torch's
    # _int_mm: VNNI or AMX-INT8 where the CPU has them). auto: bf16 where it applies, else
    # float32.
    activations: Literal["auto", "float32", "bf16", "int8"] = "auto"


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (``[N, K]`` int8, ``[N]`` float32 scales)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero row stays zero
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8(Quantizer):
    def __init__(self, checkpoint_config=None, options: Int8Options | None = None) -> None:
        super().__init__(checkpoint_config, options or Int8Options())
        self.workspace = Workspace()
        self.kernels: set[str] = set()  # the kernels the layers run

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        layer.qweight = param(torch.empty(spec.out_features, spec.in_features, dtype=torch.int8))  # [N, K]
        layer.scales = param(torch.empty(spec.out_features, dtype=torch.float32))  # [N]

    def load_weight(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int) -> None:
        check_name(self, name, ("weight",))
        q, scale = quantize_rows(tensor.to(layer.qweight.device))
        load_shard(layer.qweight, q, layer.spec, shard, dim=0, name=name)
        load_shard(layer.scales, scale, layer.spec, shard, dim=0, name=name)

    def process_weights(self, layer: nn.Module) -> None:
        kernel = self.options.kernel
        if kernel in ("auto", "cpu"):
            problem = cpu_kernel_problem(layer.qweight.device, layer.spec.dtype)
            if problem and kernel == "cpu":
                raise ValueError(f"int8 kernel cpu cannot run: {problem}")
            kernel = "dequant" if problem else "cpu"
        if self.options.activations in ("int8", "bf16") and kernel != "cpu":
            raise ValueError(f"int8 option activations: {self.options.activations} needs the cpu kernel (float32 "
                             f"compute on a CPU where it builds); this layer would run {kernel}")
        if self.options.activations == "bf16" and not torch.ops.modserve_int8.bf16_tiles():
            raise ValueError("int8 option activations: bf16 needs AMX-BF16 tiles, which this CPU lacks "
                             "(torch's cpublas::could_pack(bfloat16) is false)")
        layer.kernel = kernel
        self.kernels.add(kernel)

    @functools.cached_property
    def activations(self) -> str:
        """The activations many-row steps take, ``auto`` resolved (after the kernel loaded)."""
        chosen = self.options.activations
        if chosen == "auto":
            chosen = "bf16" if "cpu" in self.kernels and torch.ops.modserve_int8.bf16_tiles() else "float32"
        logger.info("int8: kernels %s; steps of more than 16 rows take %s activations (option activations: %s)",
                    ", ".join(sorted(self.kernels)), chosen, self.options.activations)
        return chosen

    def traceable(self) -> bool:
        return self.kernels == {"cpu"}  # one C++ op with a fake; dequant's workspace is Python state

    def cpu_op(self) -> str:
        return {"float32": "linear", "bf16": "linear_bf16", "int8": "linear_dynamic"}[self.activations]

    def native_op(self, layer: nn.Module) -> tuple[str, list[torch.Tensor | None]] | None:
        if layer.kernel != "cpu":
            return None
        return f"modserve_int8::{self.cpu_op()}", [layer.qweight, layer.scales, layer.bias]

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.kernel == "cpu":
            op = getattr(torch.ops.modserve_int8, self.cpu_op())
            return op(x, layer.qweight, layer.scales, layer.bias)  # [T, N]
        if layer.kernel == "int8pack":
            y = torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.scales.to(x.dtype))  # [T, N]
            return y if layer.bias is None else y + layer.bias
        # x @ (q * s).T = (x @ q.T) * s: convert q (a plain, vectorized copy), scale the output.
        q = layer.qweight
        w = self.workspace.get("w", tuple(q.shape), x.dtype, q.device).copy_(q)  # [N, K]
        y = F.linear(x, w).mul_(layer.scales.to(x.dtype))  # [T, N]
        return y if layer.bias is None else y.add_(layer.bias)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.qweight.float() * layer.scales[:, None]

    def weight_bytes(self, spec: LinearSpec) -> int:
        return spec.out_features * spec.in_features + 4 * spec.out_features


def cpu_kernel_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``modserve_int8::linear`` cannot run a layer, or None (it is then loaded)."""
    if device.type != "cpu":
        return f"the weights are on {device.type}, not a CPU"
    if dtype != torch.float32:
        return f"it computes in float32, this model in {str(dtype).removeprefix('torch.')}"
    return load_cpu_kernel()


def _linear_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


@functools.cache
def load_cpu_kernel() -> str | None:
    """Build or load ``modserve_int8::linear`` (with the shape function compiled regions
    trace it by); None when loaded, else why not."""
    problem = load_kernel("modserve_int8_linear", str(KERNEL))
    if problem is None:
        torch.library.register_fake("modserve_int8::linear")(_linear_fake)
        torch.library.register_fake("modserve_int8::linear_dynamic")(_linear_fake)
        torch.library.register_fake("modserve_int8::linear_bf16")(_linear_fake)
    return problem
