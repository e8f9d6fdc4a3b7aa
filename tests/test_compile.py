"""The compiled path (compile: on) against the oracle: transformers in float32 on a
bfloat16 checkpoint, whose weights float32 holds exactly. Steps of up to 16 sequences then
read the 16-bit copy (the C++ kernel, or the compiled GEMV for one row); greedy tokens must
not change."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from modserve import LLM, SamplingParams
from modserve.testing import cached_checkpoint

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog", "café naïve 日本語 😀 and then",
           "one two three four five six seven eight nine ten eleven twelve"]
MAX_NEW = 10
# The few-rows route (float32 GEMMs, a bf16 copy for decode) on any CPU: these tests are about
# it; the bf16-GEMM route that CPUs with AMX take by default is tests/test_cpu_routes.py's.
FEW_ROWS = {"name": "cpu", "options": {"bf16_gemm": "off"}}


@pytest.fixture(scope="module")
def bf16_reference():
    path = str(cached_checkpoint("llama", "tiny", dtype="bfloat16"))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = [tok.encode(p) for p in PROMPTS]
    with torch.no_grad():
        outs = [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                               do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in ids]
    return path, ids, outs


@pytest.fixture(scope="module")
def compiled_llm(bf16_reference):
    return LLM(bf16_reference[0], compile="on", num_kv_blocks=128, progress=False, platform=FEW_ROWS)


def test_compile_on_uses_the_16bit_decode_weights(compiled_llm):
    runner = compiled_llm.engine.runner
    assert runner.compiled and runner.dtype == torch.float32
    decode = [m.decode_weight for m in runner.model.modules() if hasattr(m, "decode_weight")]
    assert decode and all(w.dtype == torch.bfloat16 for w in decode)
    assert runner.decode_weight_bytes < runner.weight_bytes


def test_compiled_greedy_matches_transformers_batched_and_alone(bf16_reference, compiled_llm):
    _, ids, expected = bf16_reference
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    together = compiled_llm.generate(ids, params, use_tqdm=False)  # decode batches of 4: the bf16 kernel
    assert [o.outputs[0].token_ids for o in together] == expected
    many = compiled_llm.generate(ids * 5, params, use_tqdm=False)  # 20 rows: float32 GEMMs
    assert [o.outputs[0].token_ids for o in many] == expected * 5
    alone = [compiled_llm.generate([p], params, use_tqdm=False)[0] for p in ids]  # one row
    assert [o.outputs[0].token_ids for o in alone] == expected


def test_compiled_logprobs_match_eager(bf16_reference, compiled_llm):
    path, ids, _ = bf16_reference
    eager = LLM(path, compile="off", num_kv_blocks=128, progress=False, platform=FEW_ROWS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    for p in ids:
        a = compiled_llm.generate([p], params, use_tqdm=False)[0].outputs[0]
        b = eager.generate([p], params, use_tqdm=False)[0].outputs[0]
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)


def test_int8_with_its_cpu_kernel_compiles_to_the_eager_tokens(bf16_reference):
    """int8's C++ op traces (Quantizer.traceable), so compile auto may compile an int8 model;
    compiled, it decodes the tokens eager int8 does. Its dequant path does not trace."""
    path, ids, _ = bf16_reference
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    runs = {}
    for compile in ("on", "off"):
        llm = LLM(path, compile=compile, quantization="int8", num_kv_blocks=128, progress=False)
        assert llm.engine.runner.compiled == (compile == "on") and llm.engine.runner.quantizer.traceable()
        runs[compile] = [o.outputs[0] for o in llm.generate(ids, params, use_tqdm=False)]
    for a, b in zip(runs["on"], runs["off"], strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)
    dequant = LLM(path, quantization={"name": "int8", "options": {"kernel": "dequant"}}, num_kv_blocks=128,
                  progress=False)
    assert not dequant.engine.runner.quantizer.traceable()


def test_compile_auto_stays_off_for_small_models(bf16_reference):
    llm = LLM(bf16_reference[0], num_kv_blocks=128, progress=False, platform=FEW_ROWS)
    assert not llm.engine.runner.compiled
    assert not any(hasattr(m, "decode_weight") for m in llm.engine.runner.model.modules())


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_no_request_compiles_after_start(bf16_reference, quantization):
    """The start-up warm-up makes every graph a request needs (layers and logits, one row
    and several), so no request stalls on a compile; nor does the first prompt long enough to
    grow the step's staging buffers (4,096 values: 3 per token and more) past their start-up
    size, which a step makes in inference mode. A fresh process: dynamo's graphs are per
    process, and this module's other tests have made them all already."""
    code = (
        "import sys, torch\n"
        "from modserve import LLM, SamplingParams\n"
        f"llm = LLM(sys.argv[1], compile='on', num_kv_blocks=128, progress=False, quantization={quantization!r})\n"
        "torch.compiler.set_stance('fail_on_recompile')\n"
        "p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)\n"
        "outs = llm.generate([[5, 6, 7], [8, 9]], p, use_tqdm=False)\n"
        "outs += llm.generate([[5, 6, 7]], p, use_tqdm=False)\n"
        "outs += llm.generate([[i % 4000 + 5 for i in range(1500)], [8, 9]], p, use_tqdm=False)\n"
        # a compile that fails a step fails its requests (finish_reason error), not the process
        "print([(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs])\n"
    )
    done = subprocess.run([sys.executable, "-c", code, bf16_reference[0]], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str([(3, "length")] * 5), done.stderr[-3000:]
