"""gptq: GPTQ checkpoints (AutoGPTQ / GPTQModel ``gptq`` and ``gptq_v2`` formats), 4 or 8 bits.

Input channel ``k`` belongs to group ``g_idx[k]`` (``k // group_size`` unless the checkpoint
was quantized in activation order, ``desc_act``):

    W.T[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

    qweight [K / pack, N]  int32, ``pack = 32 / bits`` consecutive input channels each
    qzeros  [groups, N / pack] int32, output channels packed in order; the ``gptq`` (v1)
            format stores ``z - 1``, ``gptq_v2`` stores ``z``
    scales  [groups, N]  float16
    g_idx   [K] int32 (optional: ``k // group_size`` when absent)

Output channels run along dim 1, so fused shards concatenate along dim 1 (of ``qzeros``:
at ``offset / pack``). Every shard of a fused layer must carry the same ``g_idx``: they
share their input, so GPTQ orders their columns alike.

Tensor parallelism (:meth:`GPTQ.tensor_layout`): a column-parallel rank takes its output
channels along dim 1 of every tensor (``g_idx`` whole). A row-parallel rank takes its input
channels: rows of ``qweight`` (``pack`` per row) and of ``g_idx``, and its groups, rows of
``scales`` and ``qzeros``; its ``g_idx`` then counts from its first group. With act order
(``desc_act``) its channels belong to any of the checkpoint's groups, so it keeps every
group's ``scales`` and ``qzeros`` and the checkpoint's ``g_idx`` (``int4pack`` cannot run
such a shard: its groups are not runs of ``group_size`` channels; auto picks ``dequant``).
``group_size`` -1 keeps its single group whole on every rank.

Kernels: ``dequant`` (any device, any g_idx) or, for 4 bits, ``int4pack``: torch's int4 CPU
kernel after permuting the input channels so that groups are contiguous; each forward
then gathers ``x[:, perm]``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from modserve.api import LinearSpec, Quantizer, TensorLayout, check_name, load_shard, param
from modserve.quantizers.packing import (
    Workspace, from_int4pack, int4pack_mm, to_int4pack, unpack_cols, unpack_rows,
)

TENSORS = ("qweight", "qzeros", "scales")


class GPTQOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # auto: dequant (torch 2.13's CPU int4 kernel is 20-75x slower than a float GEMM, see awq.py).
    kernel: Literal["auto", "dequant", "int4pack"] = "auto"


class GPTQ(Quantizer):
    checkpoint_methods = ("gptq",)

    def __init__(self, checkpoint_config=None, options: GPTQOptions | None = None) -> None:
        super().__init__(checkpoint_config, options or GPTQOptions())
        cfg = self.checkpoint_config
        self.bits = int(cfg.get("bits", 4))
        if self.bits not in (4, 8):
            raise ValueError(f"gptq supports 4 and 8 bits, not {self.bits}")
        fmt = cfg.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq: checkpoint_format {fmt!r} is not supported (supported: gptq, gptq_v2)")
        self.zero_offset = 1 if fmt == "gptq" else 0  # v1 stores z - 1
        self.pack = 32 // self.bits
        self.group_size = int(cfg.get("group_size", 128))
        self.desc_act = bool(cfg.get("desc_act", False))
        self.workspace = Workspace()

    def groups(self, spec: LinearSpec) -> tuple[int, int]:
        """(group size, number of groups the layer keeps); group_size -1 means one group of
        every input channel (on each rank of a row-parallel layer: its own channels)."""
        if self.group_size == -1:
            return spec.in_features, 1
        k = spec.full_in_features if self.whole_groups(spec) else spec.in_features
        return self.group_size, k // self.group_size

    def whole_groups(self, spec: LinearSpec) -> bool:
        """A row-parallel shard of an act-order checkpoint: its input channels belong to any of
        the checkpoint's groups, so it keeps all of them (scales, zeros) and their ``g_idx``."""
        return spec.parallel == "row" and spec.tp_size > 1 and self.desc_act and self.group_size != -1

    def kernel(self, spec: LinearSpec) -> str:
        return "dequant" if self.options.kernel == "auto" else self.options.kernel

    def tensor_layout(self, name: str, spec: LinearSpec) -> TensorLayout:
        if name == "qweight":  # [K / pack, N]
            return TensorLayout(out_dim=1, in_dim=0, in_per_element=self.pack)
        if name == "g_idx":  # [K]
            return TensorLayout(out_dim=None, in_dim=0)
        # qzeros [groups, N / pack], scales [groups, N]: a group per row, unless every rank keeps them all
        keep = self.group_size == -1 or self.whole_groups(spec)
        return TensorLayout(out_dim=1, in_dim=None if keep else 0,
                            out_per_element=self.pack if name == "qzeros" else 1, in_per_element=max(self.group_size, 1))

    def tensor_names(self, spec: LinearSpec) -> tuple[str, ...]:
        return TENSORS

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        k, n, p = spec.in_features, spec.out_features, self.pack
        g, groups = self.groups(spec)
        whole = self.whole_groups(spec)
        # (a rank's first row or input is a multiple of its share: these checks cover it too)
        if (spec.full_in_features if whole else k) % g or k % p or any(size % p for size in spec.shard_sizes):
            what = "" if spec.tp_size == 1 else f" (this rank's share over {spec.tp_size} tensor-parallel ranks)"
            raise ValueError(f"gptq: a layer of {k} inputs and output shards {spec.shard_sizes}{what} does not fit "
                             f"group size {g} and {p} values per int32")
        layer.kernel = self.kernel(spec)
        if layer.kernel == "int4pack" and whole:
            raise ValueError("gptq: kernel int4pack cannot run a row-parallel shard of an act-order (desc_act) "
                             "checkpoint: its input channels do not form whole groups; use kernel dequant or auto")
        layer.qweight = param(torch.empty(k // p, n, dtype=torch.int32))
        layer.qzeros = param(torch.empty(groups, n // p, dtype=torch.int32))
        layer.scales = param(torch.empty(groups, n, dtype=torch.float16))
        layer.g_idx = param(torch.empty(k, dtype=torch.int32))

    def load_weight(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int) -> None:
        check_name(self, name, (*TENSORS, "g_idx"))
        if name == "g_idx":
            tensor = self._local_g_idx(layer.spec, tensor)
            if any(n == "g_idx" for n, _ in layer.loaded):  # a later shard of a fused layer
                if not torch.equal(layer.g_idx, tensor.to(layer.g_idx)):
                    raise ValueError("gptq: the shards of a fused layer have different g_idx")
                return
            with torch.no_grad():
                layer.g_idx.copy_(tensor)
            return
        load_shard(getattr(layer, name), tensor, layer.spec, shard, dim=1, name=name,
                   pack=self.pack if name == "qzeros" else 1)

    def _local_g_idx(self, spec: LinearSpec, g_idx: torch.Tensor) -> torch.Tensor:
        """This layer's rank's ``g_idx``: a row-parallel shard's counts from its first group
        (unless it keeps every group); each must name a group the layer keeps."""
        g, groups = self.groups(spec)
        if spec.parallel == "row" and spec.tp_size > 1 and not self.whole_groups(spec):
            g_idx = g_idx - (spec.in_start // g if self.group_size != -1 else 0)
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            hint = "; is it act-order (desc_act) though its config says otherwise?" if spec.tp_size > 1 else ""
            raise ValueError(f"gptq: g_idx names groups outside the layer's {groups}{hint}")
        return g_idx

    def process_weights(self, layer: nn.Module) -> None:
        spec = layer.spec
        k, whole = spec.in_features, self.whole_groups(spec)
        g, _ = self.groups(spec)
        in_order = torch.arange(k, device=layer.g_idx.device, dtype=torch.int32) // g
        if not any(n == "g_idx" for n, _ in layer.loaded):
            with torch.no_grad():  # groups in input order; a shard that keeps every group starts at its own
                layer.g_idx.copy_((torch.arange(k, dtype=torch.int32) + spec.in_start) // g if whole else in_order)
        # Channels sorted by group: with act order, x[:, perm] makes the groups contiguous.
        perm = torch.argsort(layer.g_idx, stable=True)
        sorted_groups = torch.equal(layer.g_idx[perm], in_order)
        layer.trivial_g_idx = not whole and torch.equal(layer.g_idx, in_order)
        if layer.kernel != "int4pack":
            return
        if not sorted_groups:
            raise ValueError("gptq: int4pack needs groups of exactly group_size channels")
        q = self._unpacked(layer)[perm]  # [K, N] in group order
        z = unpack_cols(layer.qzeros, self.bits) + self.zero_offset  # [groups, N]
        packed, scales_zeros = to_int4pack(q, layer.scales, z, layer.spec.dtype)
        del layer.qweight, layer.qzeros, layer.scales
        layer.packed, layer.scales_zeros = param(packed), param(scales_zeros)
        layer.perm = None if layer.trivial_g_idx else param(perm)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.kernel == "int4pack":
            if layer.perm is not None:
                x = x.index_select(1, layer.perm)  # [T, K] in group order
            y = int4pack_mm(x.contiguous(), layer.packed, self.groups(layer.spec)[0], layer.scales_zeros)
        else:
            w = self._dequantized(layer)  # [K, N]
            y = x @ (w if x.dtype == torch.float32 else w.to(x.dtype))
        return y if layer.bias is None else y + layer.bias

    def _unpacked(self, layer: nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:  # [K, N] int32
        return unpack_rows(layer.qweight, self.bits, out=out)

    def _dequantized(self, layer: nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:  # [K, N] float32
        k, n = layer.spec.in_features, layer.spec.out_features
        g, groups = self.groups(layer.spec)
        ws, dev = self.workspace, layer.qweight.device
        q = self._unpacked(layer, out=ws.get("q", (k, n), torch.int32, dev))
        z = unpack_cols(layer.qzeros, self.bits).add_(self.zero_offset)  # [groups, N]
        s = layer.scales.float()  # [groups, N]
        w = out if out is not None else ws.get("w", (k, n), torch.float32, dev)
        if layer.trivial_g_idx:  # groups are runs of g rows: broadcast instead of gathering
            q.view(groups, g, n).sub_(z[:, None, :])
            w.copy_(q).view(groups, g, n).mul_(s[:, None, :])
        else:
            idx = layer.g_idx.long()
            q.sub_(torch.index_select(z, 0, idx, out=ws.get("zg", (k, n), torch.int32, dev)))
            w.copy_(q).mul_(torch.index_select(s, 0, idx, out=ws.get("sg", (k, n), torch.float32, dev)))
        return w

    def dequantize(self, layer: nn.Module) -> torch.Tensor:  # [N, K]
        k, n = layer.spec.in_features, layer.spec.out_features
        if layer.kernel == "int4pack":
            g, _ = self.groups(layer.spec)
            q, s, z = from_int4pack(layer.packed, k, g, layer.scales_zeros)  # q in group order
            if layer.perm is not None:
                q = torch.empty_like(q).index_copy_(0, layer.perm.long(), q)  # back to input order
            idx = layer.g_idx.long()
            return ((q - z[idx]) * s[idx]).t()
        return self._dequantized(layer, out=torch.empty(k, n)).t()

    def weight_bytes(self, spec: LinearSpec) -> int:
        k, n = spec.in_features, spec.out_features
        _, groups = self.groups(spec)
        if self.kernel(spec) == "int4pack":
            perm = 0 if not self.desc_act else 8 * k
            return k * n // 2 + groups * n * 2 * spec.dtype.itemsize + 4 * k + perm
        return k * n * self.bits // 8 + groups * n * self.bits // 8 + groups * n * 2 + 4 * k
