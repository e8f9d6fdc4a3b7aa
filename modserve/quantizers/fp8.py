"""fp8: e4m3 weights with one scale per output channel, quantized from a float checkpoint at load.

    s[n] = max_k |W[n, k]| / 448        q = e4m3(W / s[:, None])        W ≈ q * s[:, None]

On GPUs whose fp8 tensor cores torch drives with row-wise scales (compute capability 9.0+:
Hopper, Blackwell) the matmul runs in fp8 with ``torch._scaled_mm``: activations are
quantized per token on the fly (``x ≈ e4m3(x / a[t]) * a[t]``) and both scales are applied
to the fp32 accumulator. (Ada, 8.9, has fp8 tensor cores too, but torch's row-wise scaled
fp8 GEMM was written for 9.0+; force ``kernel: scaled_mm`` to try it there.)
Elsewhere the weight is dequantized to the activation dtype and multiplied as usual.

Under tensor parallelism the default ``[out, in]`` layout applies: a column-parallel rank
quantizes whole rows (TP=1's weights exactly), a row-parallel one its share of each row's
inputs, with scales of its own.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from torch import nn

from modserve.api.fp8 import FP8, FP8_MAX, fp8_to_float, to_fp8
from modserve.api import LinearSpec, Quantizer, check_name, load_shard, param
from modserve.quantizers.packing import Workspace


class FP8Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # scaled_mm: fp8 x fp8 matmul (activations quantized per token); dequant: weights to float.
    # auto: scaled_mm on CUDA devices of compute capability 9.0 or newer, dequant elsewhere.
    kernel: Literal["auto", "scaled_mm", "dequant"] = "auto"


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (``[N, K]`` e4m3, ``[N]`` float32 scales)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return to_fp8(w, scale[:, None]), scale


def has_rowwise_fp8(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


class FP8Weights(Quantizer):
    def __init__(self, checkpoint_config=None, options: FP8Options | None = None) -> None:
        super().__init__(checkpoint_config, options or FP8Options())
        self.workspace = Workspace()

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        layer.qweight = param(torch.empty(spec.out_features, spec.in_features, dtype=FP8))  # [N, K]
        layer.scales = param(torch.empty(spec.out_features, dtype=torch.float32))  # [N]

    def load_weight(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int) -> None:
        check_name(self, name, ("weight",))
        q, scale = quantize_rows(tensor.to(layer.qweight.device))
        load_shard(layer.qweight, q, layer.spec, shard, dim=0, name=name)
        load_shard(layer.scales, scale, layer.spec, shard, dim=0, name=name)

    def process_weights(self, layer: nn.Module) -> None:
        kernel = self.options.kernel
        if kernel == "auto":
            kernel = "scaled_mm" if has_rowwise_fp8(layer.qweight.device) else "dequant"
        layer.kernel = kernel

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.kernel == "scaled_mm":
            return self._scaled_mm(layer, x)
        # x @ (q * s).T = (x @ q.T) * s: the scales go on the output, not on every weight
        y = F.linear(x, self._unscaled(layer, x.dtype)).mul_(layer.scales.to(x.dtype))  # [T, N]
        return y if layer.bias is None else y.add_(layer.bias)

    def _scaled_mm(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        # NOTE: _scaled_mm wants row counts that are multiples of 16; pad with zero rows.
        pad = -t % 16
        x = F.pad(x, (0, 0, 0, pad)) if pad else x
        a = x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX  # [T, 1] per-token scale
        a = torch.where(a == 0, torch.ones_like(a), a)
        out_dtype = torch.bfloat16 if x.is_cuda else torch.float32  # CUDA's row-wise scaling wants bf16
        y = torch._scaled_mm(to_fp8(x, a), layer.qweight.t(),  # [T, K] x [K, N], N-major as required
                             scale_a=a, scale_b=layer.scales[None, :], out_dtype=out_dtype)  # [T, N]
        y = y[:t].to(x.dtype)
        return y if layer.bias is None else y + layer.bias

    def _unscaled(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:  # [N, K], q as floats
        q = layer.qweight
        shape, dev = tuple(q.shape), q.device
        w = fp8_to_float(q, out=self.workspace.get("w", shape, torch.float32, dev),
                         index=self.workspace.get("index", shape, torch.int32, dev))
        return w if dtype == torch.float32 else w.to(dtype)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.qweight.float() * layer.scales[:, None]

    def weight_bytes(self, spec: LinearSpec) -> int:
        return spec.out_features * spec.in_features + 4 * spec.out_features
