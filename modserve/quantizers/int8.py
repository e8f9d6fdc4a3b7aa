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

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from torch import nn

from modserve.api import LinearSpec, Quantizer, check_name, load_shard, param
from modserve.quantizers.packing import Workspace


class Int8Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # int8pack: torch's _weight_int8pack_mm; dequant: int8 -> float, then a float GEMM.
    # auto: dequant. NOTE: torch 2.13's CPU _weight_int8pack_mm costs time linear in the rows even
    # on AVX-512 (a [T, 768] x [768, 2048] product, 1 thread: 1.7 ms at T=1, 100 ms at 64, against
    # 0.25 and 3.1 ms for dequant), so it runs only when named.
    kernel: Literal["auto", "int8pack", "dequant"] = "auto"


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
        layer.kernel = "dequant" if kernel == "auto" else kernel

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
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
