"""The cuda platform's Triton LoRA kernel against the torch reference (TorchLoRAKernel), op by op,
and through the engine against transformers + peft.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (conftest sets
TRITON_INTERPRET=1 before anything imports them): slow, so the shapes are small.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the Triton LoRA kernel needs the triton package")

from modserve.api import LoRAMapping  # noqa: E402
from modserve.plugins.platforms.cuda.lora_triton import TritonLoRAKernel  # noqa: E402
from modserve.runner.lora import TorchLoRAKernel  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Within a few units in the last place of y's largest element: the reference rounds its delta
# to the dtype before adding it to y, the kernel adds in float32 and rounds once.
ULPS = 8


def weights(in_features: int, outs: list[int], ranks: dict[int, int], max_loras: int, max_rank: int,
            dtype: torch.dtype, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per slice a ``[max_loras, max_rank, in]`` and b ``[max_loras, out, max_rank]`` as LinearLoRA
    holds them: slot -> rank in ``ranks`` filled (zero past its rank), other slots zero."""
    gen = torch.Generator().manual_seed(seed)
    a = [torch.zeros(max_loras, max_rank, in_features) for _ in outs]
    b = [torch.zeros(max_loras, out, max_rank) for out in outs]
    for slot, r in ranks.items():
        for a_i, b_i in zip(a, b):
            a_i[slot, :r] = torch.randn(r, in_features, generator=gen) * 0.3
            b_i[slot, :, :r] = torch.randn(b_i.shape[1], r, generator=gen) * 0.3
    return [t.to(DEVICE, dtype) for t in a], [t.to(DEVICE, dtype) for t in b]


def compare(num_rows: int, in_features: int, outs: list[int], ranks: dict[int, int],
            groups: list[tuple[int, list[int] | None]], dtype: torch.dtype = F32, max_loras: int = 4,
            max_rank: int = 8) -> None:
    """The kernel and the reference on copies of one y: within the dtype's rounding; rows in no group
    untouched, bit for bit."""
    a, b = weights(in_features, outs, ranks, max_loras, max_rank, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_rows, in_features, generator=gen).to(DEVICE, dtype)
    y = torch.randn(num_rows, sum(outs), generator=gen).to(DEVICE, dtype)
    scaling = [0.5 + slot for slot in range(max_loras)]
    mapping = LoRAMapping([(slot, None if rows is None else torch.tensor(rows, device=DEVICE))
                           for slot, rows in groups])
    want, got = y.clone(), y.clone()
    TorchLoRAKernel().add(want, x, a, b, scaling, mapping)
    TritonLoRAKernel().add(got, x, a, b, scaling, mapping)
    assert got.dtype == dtype and got.shape == y.shape
    assert not torch.equal(want, y), "the adapters change y: a real check"
    atol = ULPS * torch.finfo(dtype).eps * want.abs().max().item()
    torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=atol)
    covered = {r for _, rows in groups for r in (range(num_rows) if rows is None else rows)}
    untouched = [r for r in range(num_rows) if r not in covered]
    assert torch.equal(got[untouched], y[untouched]), "a row of no adapter changed"


def test_runs_under_the_interpreter_without_a_gpu() -> None:
    from modserve.plugins.platforms.cuda import lora_kernels

    assert lora_kernels.interpreted() == (not torch.cuda.is_available())


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_one_group_of_every_row(dtype):
    compare(5, 32, [32], {2: 8}, [(2, None)], dtype)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_groups_of_interleaved_rows_and_rows_of_no_adapter(dtype):
    """Rows 2 and 6 use no adapter; slots 3, 0 and 1 take interleaved rows, in no slot order."""
    compare(9, 32, [48], {0: 8, 1: 8, 3: 8}, [(3, [0, 4, 8]), (0, [1, 5]), (1, [3, 7])], dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fused_qkv_slices_of_different_sizes(dtype):
    """q, k, v of 40, 24 and 24 columns: each slice's update lands in its own columns."""
    compare(6, 32, [40, 24, 24], {0: 8, 2: 8}, [(2, [0, 2, 3]), (0, [1, 5])], dtype)


def test_more_slices_than_one_launch_takes():
    compare(4, 16, [16, 8, 8, 24], {1: 4}, [(1, [0, 3])])


def test_ranks_below_max_rank_and_a_rank_not_a_power_of_two():
    """max_rank 12: slot 1 holds rank 3 (zero past it), slot 2 rank 12; rank tiles of 16 are masked."""
    compare(7, 24, [20], {1: 3, 2: 12}, [(1, [0, 1, 6]), (2, [2, 4])], max_rank=12)


def test_sizes_not_powers_of_two_and_more_rows_than_a_tile():
    """in 40 and out 70 cross 64-wide tiles; 37 rows of one group span several 32-row tiles."""
    compare(40, 72, [70], {0: 8, 3: 8}, [(0, list(range(0, 37))), (3, [38, 39])])


def test_a_new_mapping_or_scaling_is_not_served_from_the_last_one():
    """The kernel builds each step's groups once per mapping: the next step's mapping, and a slot
    reloaded with another scaling under the same mapping, must be read afresh."""
    a, b = weights(16, [16], {0: 4, 1: 4}, 2, 4, F32)
    x, y = torch.randn(4, 16).to(DEVICE), torch.zeros(4, 16, device=DEVICE)
    kernel, ref = TritonLoRAKernel(), TorchLoRAKernel()
    first = LoRAMapping([(0, torch.tensor([0, 1], device=DEVICE))])
    second = LoRAMapping([(1, torch.tensor([2, 3], device=DEVICE))])
    for mapping, scaling in [(first, [1.0, 1.0]), (first, [3.0, 1.0]), (second, [3.0, 1.0])]:
        want, got = y.clone(), y.clone()
        ref.add(want, x, a, b, scaling, mapping)
        kernel.add(got, x, a, b, scaling, mapping)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_refuses_cpu_without_the_interpreter(monkeypatch):
    kernel = TritonLoRAKernel()
    monkeypatch.setattr(kernel.kernels, "interpreted", lambda: False)
    mapping = LoRAMapping([(0, None)])
    a, b = weights(16, [16], {0: 4}, 1, 4, F32)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        kernel.add(torch.zeros(2, 16), torch.zeros(2, 16), [t.cpu() for t in a], [t.cpu() for t in b], [1.0], mapping)


def test_the_cuda_platform_offers_it_where_triton_imports(monkeypatch):
    from modserve.plugins.platforms import cuda
    from modserve.plugins.platforms.cuda.platform import CudaPlatform

    platform = CudaPlatform(torch.device("cuda"))  # makes nothing on the device
    assert isinstance(platform.lora_kernel(), TritonLoRAKernel)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton fails
    monkeypatch.delitem(sys.modules, "modserve.plugins.platforms.cuda.lora_kernels")
    monkeypatch.delattr(cuda, "lora_kernels")  # imported again, so it imports triton again
    assert platform.lora_kernel() is None  # the runner's torch reference then


# Compiles both kernels for an sm_90 GPU (TTIR, PTX, cubin through the wheel's ptxas): needs no GPU.
COMPILE = """
import inspect, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from modserve.plugins.platforms.cuda import lora_kernels as K
assert not K.interpreted()
for dt in ("fp32", "bf16"):
    for fn, consts in ((K._shrink_kernel, dict(TILES_R=1, BLOCK_R=16, BLOCK_K=64)),
                       (K._expand_kernel, dict(TILES_N=2, BLOCK_N=64, BLOCK_K=16, start0=0, out1=1))):
        consts.update(PRECISION="ieee" if dt == "fp32" else None, DOT_F32=False, BLOCK_M=16)
        ints = ("rows_ptr", "starts_ptr", "slots_ptr")
        sig = {n: "constexpr" if n in consts else "*i32" if n in ints else "*fp32" if n in ("h_ptr", "scaling_ptr")
               else f"*{dt}" if n.endswith("_ptr") else "i32" for n in inspect.signature(fn.fn).parameters}
        triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles them in every other test")
def test_the_kernels_compile_for_a_gpu(tmp_path):
    """The interpreter runs Python, not Triton's compiler: a kernel it runs may still not compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


# -- end to end: the engine with the kernel in the platform's seam, against transformers + peft ---
MAX_NEW = 4


def test_engine_with_the_triton_kernel_matches_peft(checkpoint_dir, tmp_path, monkeypatch):
    """A batch of the base model and two adapters (rank 4 of max 8 on q/k/v/o; rank 8 on every
    projection) in the same steps: greedy tokens equal peft's, float32. On CPU the kernel goes into
    the cpu platform's seam (it runs there under the interpreter only); on a GPU into cuda's own."""
    from transformers import AutoTokenizer

    from hf_oracle import PROMPTS
    from lora_oracle import ALL, ATTN, make_adapter, peft_greedy
    from modserve import LLM, LoRARequest, SamplingParams
    from modserve.plugins.platforms.cpu.platform import CpuPlatform
    from modserve.plugins.platforms.cuda.platform import CudaPlatform

    class Counting(TritonLoRAKernel):
        calls = 0

        def add(self, *args) -> None:
            Counting.calls += 1
            super().add(*args)

    base = checkpoint_dir("llama")
    adapters = [make_adapter(base, tmp_path / "attn", 4, ATTN, seed=11),
                make_adapter(base, tmp_path / "all", 8, ALL, seed=12)]
    ids = [AutoTokenizer.from_pretrained(base).encode(p) for p in PROMPTS[:2]]
    platform = CudaPlatform if DEVICE.type == "cuda" else CpuPlatform
    monkeypatch.setattr(platform, "lora_kernel", lambda self: Counting())
    llm = LLM(base, device=DEVICE.type, dtype="float32", num_kv_blocks=128, progress=False, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    requests = [None, LoRARequest("attn", 1, adapters[0]), LoRARequest("all", 2, adapters[1])]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([p for p in ids for _ in requests], params, use_tqdm=False,
                        lora_request=[r for _ in ids for r in requests])
    got = [o.outputs[0].token_ids for o in outs]
    refs = {a: peft_greedy(base, a, ids, MAX_NEW)[0] for a in [None, *adapters]}
    want = [refs[a][i] for i in range(len(ids)) for a in [None, *adapters]]
    assert got == want
    assert refs[adapters[0]] != refs[None] and refs[adapters[1]] != refs[None]  # the adapters matter
    assert Counting.calls > 0  # the Triton kernel, not the reference, added the updates
