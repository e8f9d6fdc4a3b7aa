"""The cpu platform's C++ LoRA kernel (csrc/lora.cpp) against the torch reference, op by op, on
the cases every LoRA kernel is checked on (tests/lora_kernel_cases.py) and a few of its own, and through the engine against
transformers + peft; the platform's choice of kernel."""

from __future__ import annotations

import logging

import pytest
import torch

from lora_kernel_cases import CASES, F32, by_dtype, check_a_new_mapping_or_scaling_is_read_afresh, compare, weights
from modserve.api import LoRAMapping
from modserve.plugins.platforms.cpu.lora import CppLoRAKernel, lora_kernel_problem
from modserve.plugins.platforms.cpu.platform import CpuOptions, CpuPlatform
from modserve.runner.lora import TorchLoRAKernel

pytestmark = pytest.mark.skipif(lora_kernel_problem() is not None, reason="the C++ LoRA kernel cannot be built here")

# float32 sums in another order than the reference's over up to 768 inputs
F32_ATOL = 1e-5


@pytest.mark.parametrize("num_rows, in_features, outs, ranks, groups, dtype, options", by_dtype(CASES))
def test_the_shared_cases(num_rows, in_features, outs, ranks, groups, dtype, options):
    compare(CppLoRAKernel(), num_rows, in_features, outs, ranks, groups, dtype, f32_atol=F32_ATOL, **options)


def test_ranks_below_max_rank_not_told_to_the_kernel():
    """The same as told: a slot's rank is then the whole max_rank, its zero padding multiplied too."""
    compare(CppLoRAKernel(), 7, 24, [20], {1: 3, 2: 12}, [(1, [0, 1, 6]), (2, [2, 4])], max_rank=12,
            tell_ranks=False, f32_atol=F32_ATOL)


def test_a_prefill_sized_batch_of_model_sized_layers():
    """512 rows, in 768, q/k/v of 768/256/256 and rank 16: the split over threads at scale."""
    compare(CppLoRAKernel(), 512, 768, [768, 256, 256], {0: 16, 1: 16},
            [(0, list(range(0, 300, 2))), (1, list(range(301, 512)))], max_loras=2, max_rank=16, f32_atol=F32_ATOL)


def test_a_new_mapping_or_scaling_is_not_served_from_the_last_one():
    check_a_new_mapping_or_scaling_is_read_afresh(CppLoRAKernel())


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

