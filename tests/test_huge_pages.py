"""The CPU platform copies the weights into memory backed by transparent huge pages: the
model computes the same, and the kernel really maps that memory with 2 MiB pages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from modserve import LLM, SamplingParams
from modserve.plugins.platforms.cpu.huge_pages import HUGE_PAGE, move_weights_to_huge_pages
from modserve.testing import cached_checkpoint

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_MODE = THP.read_text().split("[")[1].split("]")[0] if THP.exists() else None
needs_thp = pytest.mark.skipif(sys.platform != "linux" or THP_MODE not in ("madvise", "always"),
                               reason=f"transparent huge pages are {THP_MODE or 'absent'} here")


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding ``address``, as /proc/self/smaps says."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


class TiedModel(torch.nn.Module):
    """An embedding tied to the LM head, and a buffer that is a view of a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(4096, 512)
        self.proj = torch.nn.Linear(512, 1024)
        self.head = torch.nn.Linear(512, 4096, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("upper", self.proj.weight.detach()[512:], persistent=False)
        self.norm = torch.nn.Parameter(torch.ones(512))  # below MIN_BYTES, as proj's bias: they stay

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * self.norm
        return self.head(x) + self.proj(x).sum(-1, keepdim=True) + self.upper.sum()


@torch.inference_mode()
def test_moved_weights_compute_the_same_and_stay_tied():
    torch.manual_seed(0)
    model = TiedModel()
    ids = torch.tensor([3, 99, 4000])
    before = model(ids)
    params = dict(model.named_parameters())
    norm_address = model.norm.data_ptr()
    moved = move_weights_to_huge_pages(model)
    assert moved.problem is None
    assert moved.moved_bytes == (4096 * 512 + 1024 * 512) * 4  # the embedding (tied: once) and proj's weight
    assert torch.equal(model(ids), before)
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    assert model.head.weight is model.embed.weight
    assert model.upper.data_ptr() == model.proj.weight.data_ptr() + 512 * 512 * 4  # still a view of it
    assert model.norm.data_ptr() == norm_address


@needs_thp
@torch.inference_mode()
def test_moved_weights_lie_in_huge_pages():
    model = TiedModel()
    moved = move_weights_to_huge_pages(model)
    # the embedding (8 MiB) starts an arena on a huge page: all of it is in huge pages
    assert huge_bytes_at(model.embed.weight.data_ptr()) >= 4 * HUGE_PAGE
    assert moved.huge_bytes >= moved.moved_bytes - HUGE_PAGE


@pytest.fixture(scope="module")
def bf16_path():
    return str(cached_checkpoint("llama", "tiny", dtype="bfloat16"))


@needs_thp
def test_a_cpu_engine_decodes_from_huge_pages_with_the_same_tokens(bf16_path):
    prompts = [[11, 250, 37, 902, 14, 3], [7] * 19]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for huge in (True, False):
        llm = LLM(bf16_path, num_kv_blocks=128, progress=False,
                  platform={"name": "cpu", "options": {"huge_pages": huge, "bf16_gemm": "off"}})
        weight = llm.engine.runner.model.get_parameter("layers.0.mlp.gate_up_proj.weight")
        if huge:
            assert huge_bytes_at(weight.data_ptr()) > 0
        elif THP_MODE == "madvise":  # nothing asked for huge pages
            assert huge_bytes_at(weight.data_ptr()) == 0
        tokens[huge] = [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * 2, use_tqdm=False)]
        del llm
    assert tokens[True] == tokens[False]
