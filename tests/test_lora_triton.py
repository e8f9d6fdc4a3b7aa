"""The cuda platform's Triton LoRA kernel against the torch reference (TorchLoRAKernel), op by op on
the cases every LoRA kernel is checked on (tests/lora_kernel_cases.py), and through the engine against transformers + peft.

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

from lora_kernel_cases import CASES, F32, by_dtype, check_a_new_mapping_or_scaling_is_read_afresh, compare, weights  # noqa: E402
from modserve.api import LoRAMapping  # noqa: E402
from modserve.plugins.platforms.cuda.lora_triton import TritonLoRAKernel  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_runs_under_the_interpreter_without_a_gpu() -> None:
    from modserve.plugins.platforms.cuda import lora_kernels

    assert lora_kernels.interpreted() == (not torch.cuda.is_available())


@pytest.mark.parametrize("num_rows, in_features, outs, ranks, groups, dtype, options", by_dtype(CASES))
def test_the_shared_cases(num_rows, in_features, outs, ranks, groups, dtype, options):
    compare(TritonLoRAKernel(), num_rows, in_features, outs, ranks, groups, dtype, tell_ranks=False, device=DEVICE,
            **options)


def test_a_new_mapping_or_scaling_is_not_served_from_the_last_one():
    check_a_new_mapping_or_scaling_is_read_afresh(TritonLoRAKernel(), DEVICE)


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
