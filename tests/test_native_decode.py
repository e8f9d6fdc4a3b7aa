"""The CPU platform's native decode step (a step of decodes as one C++ call) against the
compiled forward it stands in for, and against transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from modserve import LLM, SamplingParams
from modserve.api import build_batch
from modserve.plugins.platforms.cpu.native_decode import NativeDecodeStep
from modserve.testing import cached_checkpoint

PROMPTS = [[11, 250, 37, 902, 14, 3], [7] * 19, [1200, 5, 5, 86, 400, 2048, 17, 9, 64, 33, 12]]
MAX_NEW = 12
FEW_ROWS = {"name": "cpu", "options": {"bf16_gemm": "off"}}  # the route these tests are about (tests/test_compile.py)


@pytest.fixture(scope="module")
def bf16_path():
    return str(cached_checkpoint("llama", "tiny", dtype="bfloat16"))


@pytest.fixture(scope="module")
def native_llm(bf16_path):
    return LLM(bf16_path, compile="on", num_kv_blocks=128, progress=False, platform=FEW_ROWS)


def _step(llm: LLM) -> NativeDecodeStep:
    step = llm.engine.runner.step_forward
    assert isinstance(step, NativeDecodeStep)
    return step


@torch.inference_mode()
def test_a_native_step_gives_the_compiled_forwards_hidden_states(native_llm):
    """Decode steps of 1, 3 and 20 sequences (the few-row kernels; float32 GEMMs and rows split
    over threads) at different lengths: the native step's hidden states and the KV it writes
    match the compiled forward's, on the same cache."""
    runner = native_llm.engine.runner
    step, bs = _step(native_llm), runner.block_size
    prompts = PROMPTS + [[(7 * i + j) % 4000 + 1 for j in range(5 + i)] for i in range(17)]
    # blocks of the idle engine's cache, written here and nowhere else
    tables = [[3, 9], [20, 4], [41, 42]] + [[50 + 2 * i, 51 + 2 * i] for i in range(17)]
    ids, meta = build_batch(prompts, [0] * len(prompts), tables, bs, runner.device)
    step(ids, meta)  # the prompts' KV, through the compiled forward (a prefill)
    lens = [len(p) for p in prompts]
    for seqs in ([0], [0, 1, 2], list(range(20))):
        ids, meta = build_batch([[100 + i] for i in seqs], [lens[i] for i in seqs], [tables[i] for i in seqs], bs,
                                runner.device)
        kv_before = [c.clone() for c in runner.kv_caches]
        native = step(ids, meta)
        kv_native = [c.clone() for c in runner.kv_caches]
        for c, saved in zip(runner.kv_caches, kv_before):
            c.copy_(saved)
        compiled = step.forward(ids, meta)
        assert native.shape == compiled.shape == (len(seqs), runner.hf_config.hidden_size)
        torch.testing.assert_close(native, compiled, atol=1e-4, rtol=1e-4)
        for a, b in zip(kv_native, runner.kv_caches):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for i in seqs:
            lens[i] += 1


def test_native_greedy_tokens_match_transformers(bf16_path, native_llm):
    model = AutoModelForCausalLM.from_pretrained(bf16_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                   do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    together = native_llm.generate(PROMPTS, params, use_tqdm=False)  # decode steps of 3: native
    assert [o.outputs[0].token_ids for o in together] == expected
    alone = [native_llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert alone == expected


def test_int8_decodes_natively_without_compile(bf16_path):
    """int8's C++ op is its native op: the step runs natively though nothing is compiled, and
    gives the tokens of the Python forward."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    tokens = {}
    for native in (True, False):
        llm = LLM(bf16_path, compile="off", quantization="int8", num_kv_blocks=128, progress=False,
                  platform={"name": "cpu", "options": {"native_decode": native}})
        assert isinstance(llm.engine.runner.step_forward, NativeDecodeStep) == native
        tokens[native] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("overrides, reason", [
    (dict(platform={"name": "cpu", "options": {"native_decode": False}}), None),
    (dict(compile="off", platform=FEW_ROWS), "layer 0's qkv (CpuLinear) has no native op"),
    (dict(compile="on", kv_cache_dtype="fp8_e4m3"), "attention backend paged has no native decode op here"),
    (dict(compile="on", attention_backend="reference"), "attention backend reference has no native decode op here"),
])
def test_where_the_native_step_cannot_run_the_log_says_which_piece(bf16_path, caplog, overrides, reason):
    with caplog.at_level("INFO", logger="modserve"):
        llm = LLM(bf16_path, num_kv_blocks=128, progress=False, **overrides)
    assert not isinstance(llm.engine.runner.step_forward, NativeDecodeStep)
    if reason:
        assert f"native decode: off ({reason})" in caplog.text


def test_a_model_with_qk_norms_keeps_the_compiled_step(caplog):
    path = str(cached_checkpoint("qwen3", "tiny", dtype="bfloat16"))
    with caplog.at_level("INFO", logger="modserve"):
        llm = LLM(path, compile="on", num_kv_blocks=128, progress=False)
    assert not isinstance(llm.engine.runner.step_forward, NativeDecodeStep)
    assert "native decode: off (Qwen3ForCausalLM describes no plain decoder layout)" in caplog.text
