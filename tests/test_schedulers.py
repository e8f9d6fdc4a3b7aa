"""Scheduling policies: same greedy output under all of them; what each policy promises."""

from __future__ import annotations

import re
import types

import pytest

from modserve import LLM, SamplingParams
from modserve.core.hookspecs import hookimpl
from modserve.core.contracts.scheduler import Schedule, SchedulerLimits
from modserve.core.registry import Registry
from modserve.core.sampling_params import SamplingParams as SP
from modserve.engine.scheduler import SchedulerCore
from modserve.core.sequence import Sequence
from modserve.plugins.kv_allocators.paged import PagedAllocator
from modserve.plugins.schedulers.fcfs import FCFSOptions, FCFSScheduler

PROMPTS = [f"request {i}: " + "the model token cache batch " * (1 + 2 * i) for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_llm(path: str, **overrides) -> LLM:
    overrides.setdefault("num_kv_blocks", 128)
    overrides.setdefault("max_model_len", 256)
    return LLM(path, dtype="float32", progress=False, **overrides)


@pytest.fixture(scope="module")
def expected(llama_dir) -> list[list[int]]:
    outs = make_llm(llama_dir, kv_allocator={"name": "paged", "options": {"enable_prefix_caching": False}},
                    max_num_batched_tokens=4096).generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(scheduler="fcfs", max_num_batched_tokens=1),  # chunks of one token
        dict(scheduler="fcfs", max_num_batched_tokens=7, block_size=4),  # chunk boundaries inside blocks
        dict(scheduler="fcfs", max_num_batched_tokens=16),
        dict(scheduler={"name": "fcfs", "options": {"long_prefill_token_threshold": 8}}),
        dict(scheduler={"name": "fcfs", "options": {"chunked_prefill": False}}, max_num_batched_tokens=256),
        dict(scheduler="static", max_num_batched_tokens=64),
        dict(scheduler="priority", max_num_batched_tokens=24),
        dict(scheduler="priority", num_kv_blocks=10, max_model_len=160),  # with preemption
        dict(scheduler="static", num_kv_blocks=10, max_model_len=160),
        dict(kv_allocator="radix", max_num_batched_tokens=7, block_size=4),  # radix tree, chunks inside blocks
        dict(kv_allocator="radix", num_kv_blocks=10, max_model_len=160),  # radix tree under preemption
        dict(scheduler="lpm", kv_allocator="radix", max_num_batched_tokens=24),
    ],
    ids=["fcfs-chunk1", "fcfs-chunk7-block4", "fcfs-chunk16", "fcfs-long-prefill8", "fcfs-nochunk", "static", "priority",
         "priority-preempt", "static-preempt", "radix-chunk7-block4", "radix-preempt", "lpm-radix"],
)
def test_greedy_identical_under_every_policy(llama_dir, expected, overrides):
    llm = make_llm(llama_dir, **overrides)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[i % 3 for i in range(len(PROMPTS))])
    assert [o.outputs[0].token_ids for o in outs] == expected


def run_to_end(eng) -> list[str]:
    finished = []
    while eng.has_unfinished_requests():
        finished += [o.request_id for o in eng.step() if o.finished]
    return finished


@pytest.mark.parametrize("allocator", ["paged", "radix"])
def test_lpm_admits_the_longest_cached_prefix_first(llama_dir, allocator):
    """One sequence slot: fcfs runs the requests in arrival order; lpm first runs the one
    whose prompt the prefix cache holds (cached by an earlier request), with the same output."""
    stem = list(range(10, 74))  # 4 full blocks
    prompts = {"cold": list(range(200, 240)), "warm-short": stem[:20] + [5, 6], "warm": stem + [7, 8]}
    finished, outputs = {}, {}
    for policy in ("fcfs", "lpm"):
        llm = make_llm(llama_dir, scheduler=policy, max_num_seqs=1,
                       kv_allocator={"name": allocator, "options": {"enable_prefix_caching": True}})
        llm.generate([stem + [1]], GREEDY, use_tqdm=False)  # caches the stem
        eng = llm.engine
        for rid, prompt in prompts.items():
            eng.add_request(rid, prompt, GREEDY)
        outs = {}
        finished[policy] = []
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    finished[policy].append(o.request_id)
                    outs[o.request_id] = o.outputs[0].token_ids
        outputs[policy] = outs
    assert finished["fcfs"] == ["cold", "warm-short", "warm"]
    assert finished["lpm"] == ["warm", "warm-short", "cold"]
    assert outputs["lpm"] == outputs["fcfs"]


def test_nochunk_requires_budget_for_a_whole_prompt(llama_dir):
    with pytest.raises(Exception, match="max_num_batched_tokens .* must be at least max_model_len"):
        make_llm(llama_dir, scheduler={"name": "fcfs", "options": {"chunked_prefill": False}},
                 max_num_batched_tokens=64)


def test_chunked_prefill_runs_beside_decodes(llama_dir):
    eng = make_llm(llama_dir, max_num_batched_tokens=16).engine
    eng.add_request("decoding", "short prompt", SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()
    eng.add_request("long", "word " * 40, SamplingParams(max_tokens=2, ignore_eos=True))
    decode_steps = 0
    while eng.requests.get("long") and eng.requests["long"].seqs[0].num_output_tokens == 0:
        outs = eng.step()
        decode_steps += any(o.request_id == "decoding" for o in outs)
    # the long prompt took ~8 chunked steps, and the decode produced a token in every one
    assert decode_steps >= 7
    run_to_end(eng)


def test_priority_order_and_preemption(llama_dir):
    eng = make_llm(llama_dir, scheduler="priority", max_num_seqs=1).engine
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for rid, prio in [("low", 5), ("high", 0), ("mid", 2)]:
        eng.add_request(rid, "some prompt " + rid, params, priority=prio)
    assert run_to_end(eng) == ["high", "mid", "low"]
    # High priority arriving when blocks are short preempts running low-priority work.
    eng = make_llm(llama_dir, scheduler="priority", num_kv_blocks=8, max_model_len=128).engine
    eng.add_request("low", "word " * 20, SamplingParams(max_tokens=40, ignore_eos=True), priority=9)
    eng.step()
    eng.add_request("high", "text " * 20, SamplingParams(max_tokens=40, ignore_eos=True), priority=0)
    assert run_to_end(eng) == ["high", "low"]
    assert eng.scheduler.preemptions["recompute"] >= 1


def test_priority_ages_waiting_requests(llama_dir):
    llm = make_llm(llama_dir, scheduler={"name": "priority", "options": {"max_wait_s": 0.001}}, max_num_seqs=1)
    eng = llm.engine
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    eng.add_request("old-low", "some prompt", params, priority=9)
    import time

    time.sleep(0.01)
    eng.add_request("new-high", "another prompt", params, priority=0)
    assert run_to_end(eng) == ["old-low", "new-high"]


def test_static_batch_makes_newcomers_wait(llama_dir):
    eng = make_llm(llama_dir, scheduler="static").engine
    eng.add_request("a", "first prompt", SamplingParams(max_tokens=10, ignore_eos=True))
    eng.step()
    eng.add_request("b", "second prompt", SamplingParams(max_tokens=2, ignore_eos=True))
    assert run_to_end(eng) == ["a", "b"]  # b is short but waits for a's batch


class FlakyPolicy(FCFSScheduler):
    """Returns an invalid schedule on chosen calls, a valid FCFS one otherwise."""

    def __init__(self, limits, options=None):
        super().__init__(limits, options)
        self.calls = 0

    def schedule(self, view):
        self.calls += 1
        good = super().schedule(view)
        if self.calls == 1:  # the whole prompt at once: over the token budget
            seq = next(iter(good.tokens))
            return Schedule(tokens={seq: seq.num_tokens})
        if self.calls == 2:  # a sequence the engine doesn't know
            from modserve.core.sampling_params import SamplingParams as SP
            from modserve.core.sequence import Sequence

            return Schedule(tokens={Sequence(999, "ghost", [1, 2], 2, SP(), 0.0): 1})
        return good


def test_invalid_schedule_refused_and_engine_keeps_serving(llama_dir):
    reg = Registry()
    reg.load_entrypoints({"modserve"})
    plugin = types.SimpleNamespace(register_schedulers=hookimpl(lambda register: register("flaky", FlakyPolicy)))
    reg.add_plugin(plugin, "flaky-plugin", distribution="modserve-flaky", version="0.1")
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64, max_model_len=256, scheduler="flaky",
              max_num_batched_tokens=4, registry=reg, progress=False)
    eng = llm.engine
    eng.add_request("r", "hello there, a prompt longer than four tokens", GREEDY)
    # The first invalid schedule sets the request apart; run alone, it gets the second one and
    # fails with it: the error names the plugin. Nothing was changed by either.
    assert eng.step() == []
    (failed,) = eng.step()
    assert failed.outputs[0].finish_reason == "error" and failed.error_kind == "plugin"
    assert re.match(r"scheduler 'flaky' from modserve-flaky 0\.1 \(plugin 'flaky-plugin'\): schedule\(\) returned "
                    r"an invalid schedule: sequence 999", failed.error)
    assert eng.allocator.num_free_blocks() == eng.allocator.num_blocks
    eng.add_request("r", "hello there, a prompt longer than four tokens", GREEDY)
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
    ref = make_llm(llama_dir).generate(["hello there, a prompt longer than four tokens"], GREEDY,
                                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_long_prefill_threshold_caps_each_prompt_chunk(llama_dir):
    llm = make_llm(llama_dir, scheduler={"name": "fcfs", "options": {"long_prefill_token_threshold": 8}})
    chunks, step = [], llm.engine.scheduler.step

    def recording_step(*args):
        scheduled = step(*args)
        chunks.extend(scheduled.num_new_tokens)
        return scheduled

    llm.engine.scheduler.step = recording_step
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert max(chunks) == 8  # the long prompts were cut, in a budget of 2048 tokens


def test_long_prefill_threshold_needs_chunked_prefill(llama_dir):
    with pytest.raises(Exception, match="long_prefill_token_threshold needs chunked_prefill"):
        make_llm(llama_dir, scheduler={"name": "fcfs", "options": {"chunked_prefill": False,
                                                                   "long_prefill_token_threshold": 8}},
                 max_num_batched_tokens=256)


@pytest.mark.parametrize("fair", [True, False])
def test_fair_share_keeps_one_large_n_from_starving_a_later_request(llama_dir, fair):
    llm = make_llm(llama_dir, max_num_seqs=8, scheduler={"name": "fcfs", "options": {"fair_share": fair}})
    eng = llm.engine
    eng.add_request("hog", [5, 6, 7], SamplingParams(n=8, temperature=1.0, seed=1, max_tokens=60, ignore_eos=True))
    for _ in range(3):  # the hog's prefill, its 8 samples forked into every slot
        eng.step()
    assert len(eng.scheduler.running) == 8
    eng.add_request("late", [9, 10], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    steps_to_first_token = None
    for step in range(1, 100):
        outs = {o.request_id: o for o in eng.step()}
        if "late" in outs and outs["late"].outputs[0].token_ids:
            steps_to_first_token = step
            break
    while eng.has_unfinished_requests():
        eng.step()
    if fair:  # half the slots go back at once: the late request starts in the next step
        assert steps_to_first_token is not None and steps_to_first_token <= 2
    else:  # plain fcfs: it waits until the hog's samples finish
        assert steps_to_first_token is None or steps_to_first_token > 50


def test_recompute_preemption_with_prefix_cache_and_chunked_prefill(llama_dir):
    """A sequence preempted by recompute comes back to its own cached blocks, which sit in
    the free pool: admitting it must count them, or allocate() fails and the requests with it."""
    sched = {"name": "fcfs", "options": {"long_prefill_token_threshold": 8}}
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    ample = make_llm(llama_dir, scheduler=sched, num_kv_blocks=64, block_size=16, max_model_len=128)
    tok = ample.get_tokenizer()
    prompts = [tok.encode(f"request {i}: " + "the model token cache batch " * 10)[:20] for i in range(3)]
    assert [len(p) for p in prompts] == [20] * 3
    expected = [o.outputs[0].token_ids for o in ample.generate(prompts, params, use_tqdm=False)]
    llm = make_llm(llama_dir, scheduler=sched, num_kv_blocks=8, block_size=16, max_model_len=128,
                   preemption_mode="recompute")
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].finish_reason, o.error) for o in outs] == [("length", None)] * 3
    assert [o.outputs[0].token_ids for o in outs] == expected
    eng = llm.engine
    stats = eng.stats()
    assert stats["preemptions_recompute"] > 0 and stats["allocator_prefix_hit_tokens"] > 0, stats
    eng.allocator.check_integrity(holders=[])
    assert eng.allocator.num_free_blocks() == eng.allocator.num_blocks


@pytest.mark.parametrize("num_blocks, others, keeps_match", [
    (3, 0, True),  # the cached prefix and the chunk after it fit
    (2, 0, False),  # they don't: the prompt is computed from the start, as scheduled
    (3, 1, False),  # they would, but only with the block another admitted sequence needs
])
def test_prefix_match_at_admission_fits_in_the_checked_blocks(num_blocks, others, keeps_match):
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    alloc = PagedAllocator(num_blocks=num_blocks, block_size=4, max_model_len=64)
    core = SchedulerCore(FCFSScheduler(limits, FCFSOptions(long_prefill_token_threshold=2)), alloc, limits, "fcfs")
    prompt = list(range(10, 19))  # 2 full blocks + 1 token
    warm = Sequence(0, "warm", prompt[:8], 8, SP(), 0.0)
    assert alloc.allocate(warm, 8)
    warm.num_computed_tokens = 8
    alloc.mark_computed(warm)
    alloc.free(warm)  # both blocks stay cached, and count as free
    assert alloc.num_free_blocks() == num_blocks
    seqs = [Sequence(1, "a", list(prompt), 9, SP(), 0.0)]
    seqs += [Sequence(2 + i, f"other{i}", [90 + i, 91, 92, 93], 4, SP(), 0.0) for i in range(others)]
    for s in seqs:
        core.add(s)
    step = core.step()  # an allocator that broke its contract would raise here
    assert step.seqs == seqs
    a = seqs[0]
    if keeps_match:
        assert step.num_new_tokens[0] == 1 and a.num_computed_tokens == 8 and len(a.block_ids) == 3
    else:
        assert step.num_new_tokens[0] == 2 and a.num_computed_tokens == 0 and len(a.block_ids) == 1
    alloc.check_integrity(holders=seqs)
    for s in seqs:
        core.remove(s)
    assert alloc.num_free_blocks() == num_blocks and not core.has_work()
