"""float8 e4m3 (``torch.float8_e4m3fn``) with scales: for fp8 weights (the ``fp8`` quantizer) and the
fp8 KV cache (the attention backends).

    x ≈ fp8(x / scale) * scale,   |x / scale| saturated at 448 (e4m3's largest finite value)

CPUs have no fp8 arithmetic: torch converts e4m3 to float one element at a time in
software. Every e4m3 value is one of 256 bytes, so a 256-entry table indexed by the raw
byte does the same conversion with one gather (:func:`fp8_to_float`).
"""

from __future__ import annotations

import functools

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def to_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x / scale`` as e4m3, saturated (an out-of-range value would become NaN)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


@functools.cache
def _table(device: torch.device) -> torch.Tensor:
    table = torch.arange(256, dtype=torch.uint8).view(FP8).float()  # [256]: value of each byte
    return table.nan_to_num_(0.0).to(device)  # 0x7f and 0xff are NaN; to_fp8 never writes them


def fp8_to_float(x: torch.Tensor, out: torch.Tensor | None = None,
                 index: torch.Tensor | None = None) -> torch.Tensor:
    """e4m3 -> float32, exactly. On CPU by table lookup; ``out`` and ``index`` (int32, as
    many elements as ``x``) are optional scratch buffers, so a hot loop allocates nothing."""
    if x.device.type != "cpu":
        return x.float() if out is None else out.copy_(x)
    flat = x.reshape(-1).view(torch.uint8)
    if index is None:
        index = flat.int()
    else:
        index = index.view(-1).copy_(flat)
    out = out if out is not None else torch.empty(x.shape, dtype=torch.float32)
    torch.index_select(_table(x.device), 0, index, out=out.view(-1))
    return out.view(x.shape)
