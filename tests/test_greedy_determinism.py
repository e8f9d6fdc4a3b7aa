"""Greedy tokens do not depend on how the runner lays out a step: a busy engine (shared
prefixes, n > 1, stop strings, too few blocks for preemption, late joins, an abort), with and
without ``async_scheduling``, gives the same outputs through the persistent input batch as
through steps built from scratch (``build_batch``), and transformers' greedy tokens where a
request runs to max_tokens."""

from __future__ import annotations

import pytest
import torch

from modserve import LLM, SamplingParams
from modserve.runner.batch import build_batch

SHARED = list(range(200, 218))  # 4.5 blocks of 4: the prompts below share their first blocks
ENGINE = dict(dtype="float32", progress=False, num_kv_blocks=16, block_size=4, max_num_seqs=6,
              max_num_batched_tokens=24, max_model_len=56, compile="off")


def workload(stops: dict[str, str]) -> list[tuple[int, str, list[int], SamplingParams]]:
    """(step to add it at, request id, prompt, params)."""
    reqs = []
    for i in range(6):
        prompt = SHARED[: 6 + 3 * i] + [300 + i] * (1 + i % 3)
        reqs.append((0, f"a{i}", prompt, SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True,
                                                         stop=[stops[f"a{i}"]] if f"a{i}" in stops else None)))
    reqs.append((0, "fork", SHARED[:10] + [401, 402], SamplingParams(temperature=0, n=2, max_tokens=9,
                                                                     ignore_eos=True)))
    reqs.append((3, "late", list(range(500, 511)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    reqs.append((5, "late2", SHARED[:13], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
    # a penalty changes greedy tokens: its row's settings must follow it as the rows move
    reqs.append((2, "penalty", SHARED[:8] + [600] * 3, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True,
                                                                      repetition_penalty=2.0)))
    return reqs


def drive(llm: LLM, stops: dict[str, str], from_scratch: bool) -> dict[str, list[tuple]]:
    """Each request's completions as the user gets them (the aborted one's too)."""
    engine, runner = llm.engine, llm.engine.runner
    if from_scratch:  # the step's tensors as the runner made them before the persistent batch
        runner.input_batch.prepare = lambda seqs, chunks, ctx, query_lens: build_batch(
            chunks, ctx, [s.block_ids for s in seqs], runner.block_size, runner.device)
    pending, final = workload(stops), {}
    for k in range(500):
        for req in [r for r in pending if r[0] == k]:
            engine.add_request(req[1], req[2], req[3])
        if k == 9 and "a3" in engine.requests:
            out = engine.abort_request("a3")
            final["a3"] = [(c.token_ids, c.finish_reason) for c in out.outputs]
        if k > 5 and not engine.has_unfinished_requests():
            break
        for o in engine.step():
            assert not o.error, o.error
            if o.finished:
                final[o.request_id] = [(list(c.token_ids), c.text, c.finish_reason) for c in o.outputs]
    assert not engine.has_unfinished_requests() and engine.scheduler.num_preemptions > 0
    return final


@pytest.fixture(scope="module")
def stops(llama_dir) -> dict[str, str]:
    """Stop strings from the middle of two requests' unstopped texts."""
    with LLM(llama_dir, **ENGINE) as llm:
        got = drive(llm, {}, from_scratch=True)
    texts = {rid: got[rid][0][1] for rid in ("a1", "a4")}
    assert all(len(t) > 6 for t in texts.values())
    return {rid: t[len(t) // 2 : len(t) // 2 + 3] for rid, t in texts.items()}


@pytest.mark.parametrize("allocator", ["paged", "radix"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_input_batch_gives_the_tokens_of_steps_built_from_scratch(llama_dir, stops, async_scheduling, allocator):
    runs = []
    for from_scratch in (False, True):
        with LLM(llama_dir, async_scheduling=async_scheduling, kv_allocator={"name": allocator}, **ENGINE) as llm:
            runs.append(drive(llm, stops, from_scratch))
    got, want = runs
    assert got == want
    assert [c[2] for c in got["a1"]] == ["stop"] and [c[2] for c in got["a4"]] == ["stop"]
    assert [c[1] for c in got["a3"]] == ["abort"]
    assert got["fork"][0][0] == got["fork"][1][0] and len(got["fork"][0][0]) == 9  # greedy samples agree


def test_busy_engine_matches_transformers_greedy(llama_dir, stops):
    """Synchronous and asynchronous engines agree (the aborted request aside: its abort lands at
    another point of its decode), and both with transformers where a request ran to max_tokens."""
    from transformers import AutoModelForCausalLM

    modes = []
    for async_scheduling in (False, True):
        with LLM(llama_dir, async_scheduling=async_scheduling, **ENGINE) as llm:
            modes.append(drive(llm, stops, from_scratch=False))
    got, overlapped = modes
    assert got.pop("a3") and overlapped.pop("a3") and got == overlapped
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    reqs = {r[1]: r for r in workload(stops)}
    for rid in ("a0", "a5", "fork", "late", "late2"):  # run to max_tokens, each prompt's blocks preempted or shared
        prompt, params = reqs[rid][2], reqs[rid][3]
        with torch.no_grad():
            gen = model.generate(torch.tensor([prompt]), max_new_tokens=params.max_tokens,
                                 min_new_tokens=params.max_tokens, do_sample=False, pad_token_id=0)
        assert got[rid][0][0] == gen[0, len(prompt):].tolist(), rid
