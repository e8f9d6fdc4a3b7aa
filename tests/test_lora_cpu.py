"""The cpu platform's C++ LoRA kernel (csrc/lora.cpp) against the torch reference, op by op, on
the Triton kernel's cases (tests/test_lora_triton.py), and through the engine against
transformers + peft; the platform's choice of kernel."""

from __future__ import annotations

import logging

import pytest
import torch

from modserve.api import LoRAMapping
from modserve.plugins.platforms.cpu.lora import CppLoRAKernel, lora_kernel_problem
from modserve.plugins.platforms.cpu.platform import CpuOptions, CpuPlatform
from modserve.runner.lora import TorchLoRAKernel

pytestmark = pytest.mark.skipif(lora_kernel_problem() is not None, reason="the C++ LoRA kernel cannot be built here")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def weights(in_features: int, outs: list[int], ranks: dict[int, int], max_loras: int, max_rank: int,
            dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per slice a ``[max_loras, max_rank, in]`` and b ``[max_loras, out, max_rank]`` as LinearLoRA
    holds them: slot -> rank in ``ranks`` filled (zero past its rank), other slots zero."""
    gen = torch.Generator().manual_seed(0)
    a = [torch.zeros(max_loras, max_rank, in_features) for _ in outs]
    b = [torch.zeros(max_loras, out, max_rank) for out in outs]
    for slot, r in ranks.items():
        for a_i, b_i in zip(a, b):
            a_i[slot, :r] = torch.randn(r, in_features, generator=gen) * 0.3
            b_i[slot, :, :r] = torch.randn(b_i.shape[1], r, generator=gen) * 0.3
    return [t.to(dtype) for t in a], [t.to(dtype) for t in b]


def compare(num_rows: int, in_features: int, outs: list[int], ranks: dict[int, int],
            groups: list[tuple[int, list[int] | None]], dtype: torch.dtype = F32, max_loras: int = 4,
            max_rank: int = 8, tell_ranks: bool = True) -> None:
    """The kernel and the reference on copies of one y: float32 within 1e-5 of y's largest element,
    16-bit within a few units in the last place (the reference rounds its delta to the dtype
    before the add, the kernel sums in float32 and rounds once); rows in no group untouched."""
    a, b = weights(in_features, outs, ranks, max_loras, max_rank, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
    y = torch.randn(num_rows, sum(outs), generator=gen).to(dtype)
    scaling = [0.5 + slot for slot in range(max_loras)]
    mapping = LoRAMapping([(slot, None if rows is None else torch.tensor(rows)) for slot, rows in groups],
                          [ranks[slot] for slot, _ in groups] if tell_ranks else None)
    want, got = y.clone(), y.clone()
    TorchLoRAKernel().add(want, x, a, b, scaling, mapping)
    CppLoRAKernel().add(got, x, a, b, scaling, mapping)
    assert got.dtype == dtype and got.shape == y.shape
    assert not torch.equal(want, y), "the adapters change y: a real check"
    scale = want.abs().max().item()
    atol = 1e-5 * scale if dtype == F32 else 8 * torch.finfo(dtype).eps * scale
    torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=atol)
    covered = {r for _, rows in groups for r in (range(num_rows) if rows is None else rows)}
    untouched = [r for r in range(num_rows) if r not in covered]
    assert torch.equal(got[untouched], y[untouched]), "a row of no adapter changed"


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_one_group_of_every_row(dtype):
    compare(5, 32, [32], {2: 8}, [(2, None)], dtype)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_groups_of_interleaved_rows_and_rows_of_no_adapter(dtype):
    """Rows 2 and 6 use no adapter; slots 3, 0 and 1 take interleaved rows, in no slot order."""
    compare(9, 32, [48], {0: 8, 1: 8, 3: 8}, [(3, [0, 4, 8]), (0, [1, 5]), (1, [3, 7])], dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fused_qkv_slices_of_different_sizes(dtype):
    """q, k, v of 40, 24 and 24 columns: each slice's update lands in its own columns, each slot
    with its own scaling."""
    compare(6, 32, [40, 24, 24], {0: 8, 2: 8}, [(2, [0, 2, 3]), (0, [1, 5])], dtype)


def test_four_slices():
    compare(4, 16, [16, 8, 8, 24], {1: 4}, [(1, [0, 3])])


@pytest.mark.parametrize("tell_ranks", [True, False])
def test_ranks_below_max_rank_and_a_rank_not_a_power_of_two(tell_ranks):
    """max_rank 12: slot 1 holds rank 3 (zero past it), slot 2 rank 12; the same told or not."""
    compare(7, 24, [20], {1: 3, 2: 12}, [(1, [0, 1, 6]), (2, [2, 4])], max_rank=12, tell_ranks=tell_ranks)


def test_sizes_not_multiples_of_a_vector_and_many_rows():
    """in 40 and out 70 leave tails past 16-wide vectors; 37 rows of one group span many row blocks."""
    compare(40, 72, [70], {0: 8, 3: 8}, [(0, list(range(0, 37))), (3, [38, 39])])


def test_a_prefill_sized_batch_of_model_sized_layers():
    """512 rows, in 768, q/k/v of 768/256/256 and rank 16: the split over threads at scale."""
    compare(512, 768, [768, 256, 256], {0: 16, 1: 16}, [(0, list(range(0, 300, 2))), (1, list(range(301, 512)))],
            max_loras=2, max_rank=16)


def test_a_new_mapping_or_scaling_is_not_served_from_the_last_one():
    """The kernel builds each step's groups once per mapping: the next step's mapping, and a slot
    reloaded with another scaling under the same mapping, must be read afresh."""
    a, b = weights(16, [16], {0: 4, 1: 4}, 2, 4, F32)
    x, y = torch.randn(4, 16), torch.zeros(4, 16)
    kernel, ref = CppLoRAKernel(), TorchLoRAKernel()
    first = LoRAMapping([(0, torch.tensor([0, 1]))])
    second = LoRAMapping([(1, torch.tensor([2, 3]))])
    for mapping, scaling in [(first, [1.0, 1.0]), (first, [3.0, 1.0]), (second, [3.0, 1.0])]:
        want, got = y.clone(), y.clone()
        ref.add(want, x, a, b, scaling, mapping)
        kernel.add(got, x, a, b, scaling, mapping)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_slot_reloaded_in_place_is_read_afresh():
    """The kernel keeps B transposed: a slot's B written in place (another adapter loaded into it,
    as LinearLoRA.set does) must reach the next call."""
    a, b = weights(16, [24], {0: 4, 1: 4}, 2, 4, F32)
    x, y = torch.randn(3, 16), torch.zeros(3, 24)
    kernel, ref = CppLoRAKernel(), TorchLoRAKernel()
    mapping = LoRAMapping([(1, None)], [4])
    for _ in range(2):
        want, got = y.clone(), y.clone()
        ref.add(want, x, a, b, [1.0, 1.0], mapping)
        kernel.add(got, x, a, b, [1.0, 1.0], mapping)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        b[0][1, :, :4].copy_(torch.randn(24, 4))


def test_strided_input_and_output():
    """x a column slice of a wider tensor, y a transposed view: read and written where they lie."""
    a, b = weights(16, [8, 8], {0: 4}, 1, 4, F32)
    x = torch.randn(5, 40)[:, 8:24]
    y = torch.randn(16, 5).t()
    mapping = LoRAMapping([(0, torch.tensor([1, 3, 4]))], [4])
    want, got = y.clone(), y.clone()
    TorchLoRAKernel().add(want, x, a, b, [2.0], mapping)
    CppLoRAKernel().add(got, x, a, b, [2.0], mapping)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[[0, 2]], y[[0, 2]])


def test_the_cpu_platform_offers_it_unless_told_not_to(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="modserve"):
        assert isinstance(CpuPlatform(torch.device("cpu")).lora_kernel(), CppLoRAKernel)
        assert CpuPlatform(torch.device("cpu"), CpuOptions(lora_kernel="torch")).lora_kernel() is None
        monkeypatch.setattr("modserve.plugins.platforms.cpu.platform.lora_kernel_problem", lambda: "no compiler")
        assert CpuPlatform(torch.device("cpu")).lora_kernel() is None  # the runner's torch reference then
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("LoRA kernel")]
    assert said == ["LoRA kernel: C++ (csrc/lora.cpp)", "LoRA kernel: the torch reference (lora_kernel: torch)",
                    "LoRA kernel: the torch reference (the C++ kernel cannot be built: no compiler)"]

