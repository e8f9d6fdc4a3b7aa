"""A fault inside an engine step fails only the request it belongs to.

The faults are planted in the sampler (the last place a request's own settings are
used), so they pass every boundary check, as an engine bug or a faulty plugin would.
In-process, so conftest's KV-leak guard checks every block came back.
"""

from __future__ import annotations

import pytest

from modserve import LLM, SamplingParams

HEALTHY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
POISON = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=12, ignore_eos=True, seed=7)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(model=llama_dir, num_kv_blocks=64, max_model_len=256, max_num_seqs=8, progress=False)


def _plant(llm: LLM, monkeypatch, fails) -> None:
    real = llm.engine.runner.sampler

    def sampler(logits, batch):
        if fails(batch):
            raise RuntimeError("planted sampler fault")
        return real(logits, batch)

    monkeypatch.setattr(llm.engine.runner, "sampler", sampler)


def test_a_poisoned_request_fails_alone_and_the_others_match_a_clean_run(llm, monkeypatch):
    clean = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, HEALTHY, use_tqdm=False)]
    # Fails any step that samples the poisoned request (the only one with temperature 0.5).
    _plant(llm, monkeypatch, lambda batch: bool((batch.temperature == 0.5).any()))
    outs = llm.generate([*PROMPTS[:2], [30, 31, 32], *PROMPTS[2:]],
                        [HEALTHY, HEALTHY, POISON, HEALTHY, HEALTHY], use_tqdm=False)
    poisoned = outs.pop(2)
    assert poisoned.finished and poisoned.outputs[0].finish_reason == "error"
    assert "planted sampler fault" in poisoned.error
    assert [o.outputs[0].token_ids for o in outs] == clean
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in outs)
    assert not llm.engine.isolation.active


def test_a_fault_mid_generation_is_isolated_too(llm, monkeypatch):
    clean = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, HEALTHY, use_tqdm=False)]
    # The poisoned request runs fine for a few tokens, then its steps fail.
    _plant(llm, monkeypatch, lambda batch: bool(((batch.temperature == 0.5)
                                                 & (batch.top_p < 0.95)).any()) and _late(llm))
    outs = llm.generate([*PROMPTS, [30, 31, 32]], [HEALTHY] * 4 + [POISON], use_tqdm=False)
    assert outs[-1].outputs[0].finish_reason == "error"
    assert 0 < len(outs[-1].outputs[0].token_ids) < 12
    assert [o.outputs[0].token_ids for o in outs[:-1]] == clean


def _late(llm: LLM) -> bool:
    return any(len(s.output_token_ids) >= 3 for r in llm.engine.requests.values() for s in r.seqs
               if s.params.temperature == 0.5)


def test_a_fault_no_single_request_causes_fails_the_batch_instead_of_looping(llm, monkeypatch):
    # Any step that samples more than one row fails: each request runs fine alone.
    _plant(llm, monkeypatch, lambda batch: batch.temperature.numel() > 1)
    outs = llm.generate(PROMPTS, HEALTHY, use_tqdm=False)
    assert all(o.finished for o in outs)
    assert {o.outputs[0].finish_reason for o in outs} == {"error"}
    assert not llm.engine.requests
