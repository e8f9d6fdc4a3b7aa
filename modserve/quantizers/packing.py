"""Unpacking the int32-packed integer formats of AWQ and GPTQ checkpoints, and a workspace.

Both formats store ``32 // bits`` small unsigned integers per int32, lowest bits first,
but pack along different dimensions and in different orders:

- AWQ (GEMM): ``qweight [in, out / 8]``: eight *output* channels per int32, in the order
  0 2 4 6 1 3 5 7 (nibble ``i`` holds channel ``AWQ_ORDER[i]``); ``qzeros [groups, out / 8]``
  the same way.
- GPTQ: ``qweight [in / pack, out]``: ``pack`` consecutive *input* channels per int32,
  in order; ``qzeros [groups, out / pack]`` packs output channels, in order.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def shifts(bits: int, order: tuple[int, ...] | None = None, device: torch.device | None = None) -> torch.Tensor:
    """``[pack]``: the right shift that reads value ``j`` of an int32 (AWQ: 0 16 4 20 8 24 12 28)."""
    pack = 32 // bits
    values = [bits * order.index(j) for j in range(pack)] if order else [bits * j for j in range(pack)]
    return torch.tensor(values, dtype=torch.int32, device=device)


def unpack_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, C / pack]`` int32 -> ``[R, C]`` int32 values in ``[0, 2**bits)``, packed along columns."""
    r, c = packed.shape
    pack = 32 // bits
    out = out if out is not None else torch.empty(r, c * pack, dtype=torch.int32, device=packed.device)
    torch.bitwise_right_shift(packed[:, :, None], shifts(bits, order, packed.device),
                              out=out.view(r, c, pack))  # [R, C/pack, pack]
    return out.bitwise_and_((1 << bits) - 1)


def unpack_rows(packed: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[R / pack, C]`` int32 -> ``[R, C]`` int32, packed along rows in order (GPTQ qweight)."""
    r, c = packed.shape
    pack = 32 // bits
    out = out if out is not None else torch.empty(r * pack, c, dtype=torch.int32, device=packed.device)
    torch.bitwise_right_shift(packed[:, None, :], shifts(bits, None, packed.device)[:, None],
                              out=out.view(r, pack, c))  # [R/pack, pack, C]
    return out.bitwise_and_((1 << bits) - 1)


class Workspace:
    """Grow-only scratch tensors, reused by every layer of a model.

    NOTE: dequantizing into fresh tensors costs a page fault per 4 KiB on every forward
    (more than the arithmetic on CPU); one buffer per name, sized for the largest layer,
    is touched once. Layers run one at a time, so they can share it.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


# -- torch's int4 CPU kernel ------------------------------------------------------------
# _weight_int4pack_mm_for_cpu(x [T, K], packed, g, sz [K/g, N, 2]) computes x @ W.T with
#   W[n, k] = (q[n, k] - 8) * sz[k // g, n, 0] + sz[k // g, n, 1]
# so a zero point z becomes the float offset (8 - z) * s: exact in float32 (a 4-bit
# integer times a float16 scale fits in float32's 24-bit mantissa).
INT4PACK_GROUP_SIZES = (32, 64, 128, 256)


def to_int4pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [K, N]``, ``scales``/``zeros [K/g, N]`` -> (packed weight, ``[K/g, N, 2]`` scales and offsets)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.t().contiguous().int(), 2)
    s = scales.float()
    return packed, torch.stack([s, (8 - zeros) * s], dim=-1).to(dtype)


def int4pack_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int,
                scales_zeros: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_zeros)


def from_int4pack(packed: torch.Tensor, in_features: int, group_size: int,
                  scales_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Back to (``q [K, N]``, scales, zeros) exactly (float32 ``scales_zeros``): the kernel
    applied to the identity with unit scales and offsets 8 returns ``q`` itself."""
    groups, n, _ = scales_zeros.shape
    unit = torch.stack([torch.ones(groups, n), torch.full((groups, n), 8.0)], dim=-1)
    eye = torch.eye(in_features)
    q = int4pack_mm(eye, packed, group_size, unit).round().int()  # [K, N]
    s = scales_zeros[..., 0].float()
    z = torch.round(8 - scales_zeros[..., 1].float() / s).int()
    return q, s, z
