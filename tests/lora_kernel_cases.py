"""The cases every platform LoRA kernel is checked on against the torch reference (TorchLoRAKernel),
op by op: tests/test_lora_cpu.py (the C++ op) and tests/test_lora_triton.py (the Triton kernels)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from modserve.api import LoRAMapping
from modserve.runner.lora import TorchLoRAKernel

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Within a few units in the last place of y's largest element: the reference rounds its delta
# to the dtype before adding it to y, a kernel adds in float32 and rounds once.
ULPS = 8

# (rows, in, slice outs, slot -> rank, groups of (slot, rows or None for all), dtypes, options)
CASES = [
    pytest.param(5, 32, [32], {2: 8}, [(2, None)], [F32, BF16, F16], {}, id="one-group-of-every-row"),
    # rows 2 and 6 use no adapter; slots 3, 0 and 1 take interleaved rows, in no slot order
    pytest.param(9, 32, [48], {0: 8, 1: 8, 3: 8}, [(3, [0, 4, 8]), (0, [1, 5]), (1, [3, 7])], [F32, BF16, F16], {},
                 id="interleaved-rows-and-rows-of-no-adapter"),
    # q, k, v of 40, 24 and 24 columns: each slice's update lands in its own columns, each slot
    # with its own scaling
    pytest.param(6, 32, [40, 24, 24], {0: 8, 2: 8}, [(2, [0, 2, 3]), (0, [1, 5])], [F32, BF16], {},
                 id="fused-qkv-slices-of-different-sizes"),
    pytest.param(4, 16, [16, 8, 8, 24], {1: 4}, [(1, [0, 3])], [F32], {}, id="four-slices"),
    # max_rank 12: slot 1 holds rank 3 (zero past it), slot 2 rank 12 (Triton's rank tiles of 16 masked)
    pytest.param(7, 24, [20], {1: 3, 2: 12}, [(1, [0, 1, 6]), (2, [2, 4])], [F32], {"max_rank": 12},
                 id="ranks-below-max-rank-and-not-a-power-of-two"),
    # in 40 and out 70 leave tails past vectors and tiles; 37 rows of one group span many row blocks
    pytest.param(40, 72, [70], {0: 8, 3: 8}, [(0, list(range(0, 37))), (3, [38, 39])], [F32], {},
                 id="sizes-not-multiples-of-a-vector-and-many-rows"),
]


def by_dtype(cases: list[Any]) -> list[Any]:
    """CASES once per dtype each lists: ``(rows, in, outs, ranks, groups, dtype, options)``."""
    return [pytest.param(*c.values[:5], dtype, c.values[6], id=f"{c.id}-{str(dtype).removeprefix('torch.')}")
            for c in cases for dtype in c.values[5]]


def weights(in_features: int, outs: list[int], ranks: dict[int, int], max_loras: int, max_rank: int,
            dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per slice a ``[max_loras, max_rank, in]`` and b ``[max_loras, out, max_rank]`` as LinearLoRA
    holds them: slot -> rank in ``ranks`` filled (zero past its rank), other slots zero."""
    gen = torch.Generator().manual_seed(0)
    a = [torch.zeros(max_loras, max_rank, in_features) for _ in outs]
    b = [torch.zeros(max_loras, out, max_rank) for out in outs]
    for slot, r in ranks.items():
        for a_i, b_i in zip(a, b):
            a_i[slot, :r] = torch.randn(r, in_features, generator=gen) * 0.3
            b_i[slot, :, :r] = torch.randn(b_i.shape[1], r, generator=gen) * 0.3
    return [t.to(device, dtype) for t in a], [t.to(device, dtype) for t in b]


def compare(kernel: Any, num_rows: int, in_features: int, outs: list[int], ranks: dict[int, int],
            groups: list[tuple[int, list[int] | None]], dtype: torch.dtype = F32, max_loras: int = 4,
            max_rank: int = 8, tell_ranks: bool = True, device: torch.device | str = "cpu",
            f32_atol: float = ULPS * torch.finfo(F32).eps) -> None:
    """``kernel`` and the reference on copies of one y: float32 within ``f32_atol`` of y's largest
    element, 16-bit within ULPS units in the last place; rows in no group untouched, bit for bit."""
    a, b = weights(in_features, outs, ranks, max_loras, max_rank, dtype, device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_rows, in_features, generator=gen).to(device, dtype)
    y = torch.randn(num_rows, sum(outs), generator=gen).to(device, dtype)
    scaling = [0.5 + slot for slot in range(max_loras)]
    mapping = LoRAMapping([(slot, None if rows is None else torch.tensor(rows, device=device)) for slot, rows in groups],
                          [ranks[slot] for slot, _ in groups] if tell_ranks else None)
    want, got = y.clone(), y.clone()
    TorchLoRAKernel().add(want, x, a, b, scaling, mapping)
    kernel.add(got, x, a, b, scaling, mapping)
    assert got.dtype == dtype and got.shape == y.shape
    assert not torch.equal(want, y), "the adapters change y: a real check"
    scale = want.abs().max().item()
    atol = f32_atol * scale if dtype == F32 else ULPS * torch.finfo(dtype).eps * scale
    torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=atol)
    covered = {r for _, rows in groups for r in (range(num_rows) if rows is None else rows)}
    untouched = [r for r in range(num_rows) if r not in covered]
    assert torch.equal(got[untouched], y[untouched]), "a row of no adapter changed"


def check_a_new_mapping_or_scaling_is_read_afresh(kernel: Any, device: torch.device | str = "cpu") -> None:
    """A kernel may build each step's groups once per mapping: the next step's mapping, and a slot
    reloaded with another scaling under the same mapping, must be read afresh."""
    a, b = weights(16, [16], {0: 4, 1: 4}, 2, 4, F32, device)
    x, y = torch.randn(4, 16).to(device), torch.zeros(4, 16, device=device)
    first = LoRAMapping([(0, torch.tensor([0, 1], device=device))])
    second = LoRAMapping([(1, torch.tensor([2, 3], device=device))])
    for mapping, scaling in [(first, [1.0, 1.0]), (first, [3.0, 1.0]), (second, [3.0, 1.0])]:
        want, got = y.clone(), y.clone()
        TorchLoRAKernel().add(want, x, a, b, scaling, mapping)
        kernel.add(got, x, a, b, scaling, mapping)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
