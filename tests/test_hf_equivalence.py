"""The oracle: transformers on the same weights, float32. Greedy tokens must match exactly."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import PROMPTS, greedy_and_logits
from modserve import LLM, SamplingParams
from modserve.core.sequence import Sequence

ARCHS = ["llama", "mistral", "qwen2"]
BACKENDS = ["reference", "paged"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def hf_reference(checkpoint_dir):
    """Per arch: prompt ids, HF greedy continuations, HF prefill logits."""
    refs = {}
    for arch in ARCHS:
        path = checkpoint_dir(arch)
        refs[arch] = (path, *greedy_and_logits(path, PROMPTS, MAX_NEW))
    return refs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(hf_reference, arch, backend):
    path, ids, expected, _ = hf_reference[arch]
    assert len({len(p) for p in ids}) == len(ids), "prompts should differ in length"
    llm = LLM(path, dtype="float32", attention_backend=backend, num_kv_blocks=128, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(ids, params, use_tqdm=False)  # all 8 submitted together
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.stats()["steps"] == MAX_NEW  # one batched forward per step, not per request


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(hf_reference, arch, backend):
    path, ids, _, expected = hf_reference[arch]
    llm = LLM(path, dtype="float32", attention_backend=backend, num_kv_blocks=128, progress=False)
    eng = llm.engine
    seqs = [Sequence(i, f"r{i}", list(p), len(p), SamplingParams(), 0.0) for i, p in enumerate(ids)]
    for s in seqs:
        assert eng.allocator.allocate(s, s.num_tokens)
    try:
        runner = eng.runner
        batch = runner._prepare(seqs, [s.num_tokens for s in seqs])
        input_ids, meta = batch.input_ids, batch.meta
        with torch.inference_mode():
            hidden = runner.model(input_ids, meta.positions, runner.kv_caches, meta, runner.attn.prepare(meta))
            logits = runner.model.compute_logits(hidden)
        got = torch.split(logits, [len(p) for p in ids])
        for g, e in zip(got, expected):
            assert (g - e).abs().max().item() < 1e-4
    finally:
        for s in seqs:
            eng.allocator.free(s)
