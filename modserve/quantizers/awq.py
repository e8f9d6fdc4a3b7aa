"""awq: AutoAWQ checkpoints in GEMM packing: 4-bit weights, a zero point and a scale per
group of ``g`` input channels. AWQ stores the transposed weight, ``W.T: [in, out]``:

    W.T[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]

    qweight [K, N / 8]  int32, 8 output channels each, nibble order 0 2 4 6 1 3 5 7
    qzeros  [K / g, N / 8] int32, packed the same way
    scales  [K / g, N]  float16

Output channels run along dim 1 of every tensor, so a fused layer's shards (q, k, v)
are concatenated along dim 1 (of ``qweight``: at ``offset / 8``). Under tensor parallelism
(:meth:`AWQ.tensor_layout`) a column-parallel rank takes its output channels along dim 1
(8 per int32 of ``qweight`` and ``qzeros``), a row-parallel one its input channels along
dim 0 (one per row of ``qweight``, a group of ``g`` per row of ``qzeros`` and ``scales``).

Kernels: ``dequant`` unpacks the weight into a reused float buffer and runs one GEMM (any
device); ``int4pack`` repacks for torch's int4 CPU kernel at load; ``triton`` is a fused
dequantize-GEMM for GPUs (:mod:`modserve.quantizers.awq_triton`).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from modserve.api import LinearSpec, Quantizer, TensorLayout, check_name, load_shard, param
from modserve.quantizers.packing import (
    AWQ_ORDER, Workspace, from_int4pack, int4pack_mm, to_int4pack, unpack_cols,
)

TENSORS = ("qweight", "qzeros", "scales")


class AWQOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # auto: triton on CUDA, else dequant. NOTE: torch 2.13's CPU int4 kernel is 20-75x slower than a
    # float GEMM even on AVX-512 ([T, 768] x [768, 2048], g128, 1 thread: 2.8 ms at T=1, 692 ms at
    # 256, against 0.12 and 9.1 ms), so int4pack runs only when named.
    kernel: Literal["auto", "dequant", "int4pack", "triton"] = "auto"


class AWQ(Quantizer):
    checkpoint_methods = ("awq",)

    def __init__(self, checkpoint_config=None, options: AWQOptions | None = None) -> None:
        super().__init__(checkpoint_config, options or AWQOptions())
        cfg = self.checkpoint_config
        bits = cfg.get("bits", cfg.get("w_bit", 4))
        version = str(cfg.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not cfg.get("zero_point", True):
            raise ValueError(f"awq supports 4-bit GEMM checkpoints with zero points; this one has bits={bits}, "
                             f"version={version!r}, zero_point={cfg.get('zero_point', True)}")
        if cfg.get("modules_to_not_convert"):
            raise ValueError(f"awq: modules_to_not_convert={cfg['modules_to_not_convert']} is not supported")
        self.group_size = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
        self.workspace = Workspace()

    def kernel(self, spec: LinearSpec) -> str:
        kernel = self.options.kernel
        if kernel != "auto":
            return kernel
        return "triton" if spec.device.type == "cuda" else "dequant"

    def tensor_names(self, spec: LinearSpec) -> tuple[str, ...]:
        return TENSORS

    def tensor_layout(self, name: str, spec: LinearSpec) -> TensorLayout:
        # every tensor is [inputs (one per row, or a group's), outputs (8 per int32 when packed)]
        return TensorLayout(out_dim=1, in_dim=0, out_per_element=1 if name == "scales" else 8,
                            in_per_element=1 if name == "qweight" else self.group_size)

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        k, n, g = spec.in_features, spec.out_features, self.group_size
        # (a rank's first row or input is a multiple of its share: these checks cover it too)
        if k % g or any(size % 8 for size in spec.shard_sizes):
            what = "" if spec.tp_size == 1 else f" (this rank's share over {spec.tp_size} tensor-parallel ranks)"
            raise ValueError(f"awq: a layer of {k} inputs and output shards {spec.shard_sizes}{what} does not fit "
                             f"group size {g} and 8 outputs per int32")
        layer.kernel = self.kernel(spec)
        layer.qweight = param(torch.empty(k, n // 8, dtype=torch.int32))
        layer.qzeros = param(torch.empty(k // g, n // 8, dtype=torch.int32))
        layer.scales = param(torch.empty(k // g, n, dtype=torch.float16))

    def load_weight(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int) -> None:
        check_name(self, name, TENSORS)
        load_shard(getattr(layer, name), tensor, layer.spec, shard, dim=1, name=name,
                   pack=1 if name == "scales" else 8)

    def process_weights(self, layer: nn.Module) -> None:
        if layer.kernel == "int4pack":
            q = unpack_cols(layer.qweight, 4, AWQ_ORDER)  # [K, N]
            z = unpack_cols(layer.qzeros, 4, AWQ_ORDER)  # [K/g, N]
            packed, scales_zeros = to_int4pack(q, layer.scales, z, layer.spec.dtype)
            del layer.qweight, layer.qzeros, layer.scales
            layer.packed, layer.scales_zeros = param(packed), param(scales_zeros)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.kernel == "int4pack":
            y = int4pack_mm(x, layer.packed, self.group_size, layer.scales_zeros)  # [T, N]
        elif layer.kernel == "triton":
            from modserve.quantizers.awq_triton import awq_gemm

            y = awq_gemm(x, layer.qweight, layer.qzeros, layer.scales, self.group_size)  # [T, N]
        else:
            w = self._dequantized(layer)  # [K, N]
            y = x @ (w if x.dtype == torch.float32 else w.to(x.dtype))
        return y if layer.bias is None else y + layer.bias

    def _dequantized(self, layer: nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:  # [K, N] float32
        k, n, g = layer.spec.in_features, layer.spec.out_features, self.group_size
        dev = layer.qweight.device
        q = unpack_cols(layer.qweight, 4, AWQ_ORDER, out=self.workspace.get("q", (k, n), torch.int32, dev))
        z = unpack_cols(layer.qzeros, 4, AWQ_ORDER)  # [K/g, N]
        q.view(k // g, g, n).sub_(z[:, None, :])  # [K/g, g, N]
        w = out if out is not None else self.workspace.get("w", (k, n), torch.float32, dev)
        w.copy_(q).view(k // g, g, n).mul_(layer.scales.float()[:, None, :])
        return w

    def dequantize(self, layer: nn.Module) -> torch.Tensor:  # [N, K]
        if layer.kernel == "int4pack":
            q, s, z = from_int4pack(layer.packed, layer.spec.in_features, self.group_size, layer.scales_zeros)
            g = self.group_size
            return ((q - z.repeat_interleave(g, 0)) * s.repeat_interleave(g, 0)).t()
        k, n = layer.spec.in_features, layer.spec.out_features
        return self._dequantized(layer, out=torch.empty(k, n)).t()

    def weight_bytes(self, spec: LinearSpec) -> int:
        k, n, groups = spec.in_features, spec.out_features, spec.in_features // self.group_size
        if self.kernel(spec) == "int4pack":
            return k * n // 2 + groups * n * 2 * spec.dtype.itemsize
        return k * n // 2 + groups * n // 2 + groups * n * 2
