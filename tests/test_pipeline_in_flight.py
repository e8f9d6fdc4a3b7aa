"""Pipeline parallel with batches in flight (``pipeline_in_flight``, on at PP > 1): up to
pp_size steps of disjoint batches go through the stages at once.

The tiny Llama at ``pipeline_parallel_size=2`` (mp executor, gloo, one thread per rank)
against one rank: the same greedy tokens, texts, stops, logprobs and prompt logprobs for a
mixed batch (10 prompts of different lengths and max_tokens, n > 1, stop strings, a small KV
cache so sequences are preempted), with async scheduling on and swap preemption, at TP=2 x
PP=2 too; structured outputs at PP=2 and TP=2 x PP=2; speculative decoding (ngram) in flight;
steps really are in flight two at a time, of disjoint sequences; an abort mid-flight and
shutdown with steps in flight leave every block free and no process behind. The scheduler's
side (what it hides, what it refuses, when it frees, a swap-out no step carries) is checked
on its own, without processes.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterator

import pytest

from modserve import LLM, SamplingParams, StructuredOutputs
from modserve.core.contracts.scheduler import Schedule, Scheduler, SchedulerLimits
from modserve.core.registry import PluginError
from modserve.core.sampling_params import SamplingParams as SP
from modserve.core.sequence import Sequence, SequenceStatus
from modserve.engine.pipeline_step import PipelinedSteps
from modserve.engine.scheduler import SchedulerCore, SwapSpace
from modserve.plugins.kv_allocators.paged import PagedAllocator
from modserve.plugins.schedulers.fcfs import FCFSScheduler

PROMPTS = [("word " * n + "end").strip() for n in (1, 3, 6, 10, 15, 21, 2, 8, 12, 30)]
# Small enough that the batch is preempted (recompute), one thread per rank.
ENGINE = dict(dtype="float32", num_threads=1, progress=False, max_model_len=128, block_size=4, num_kv_blocks=48,
              max_num_batched_tokens=96)


def seen(outs) -> list[list[tuple]]:
    """Everything a user sees of each output, but the logprobs (same_logprobs)."""
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def same_logprobs(a, b) -> None:
    """The same top entries, each logprob within 1e-4 (the stages' float32 sums differ in order)."""
    for x, y in zip((e for o in a for c in o.outputs for e in c.logprobs or []),
                    (e for o in b for c in o.outputs for e in c.logprobs or []), strict=True):
        assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def same_prompt_logprobs(a, b) -> int:
    """Every prompt token's entry the same (its token, rank and top tokens), each logprob within
    1e-4; returns how many entries were compared."""
    pairs = list(zip((e for o in a for e in o.prompt_logprobs or []), (e for o in b for e in o.prompt_logprobs or []),
                     strict=True))
    for x, y in pairs:
        assert (x is None) == (y is None)
        if x is not None:
            assert (x["token_id"], x["rank"], x["top"].keys()) == (y["token_id"], y["rank"], y["top"].keys())
            assert abs(x["logprob"] - y["logprob"]) < 1e-4
            assert all(abs(x["top"][t] - y["top"][t]) < 1e-4 for t in x["top"])
    return sum(x is not None for x, _ in pairs)


def watch_steps(llm: LLM) -> dict[str, int]:
    """Count, on rank 0, how deep the pipeline got; fail a step that shares a sequence with one in flight."""
    eng, seen_depth = llm.engine, {"max": 0, "submitted": 0}
    submit = eng.runner.submit

    def watched(scheduled):
        in_flight = {s for step in eng.overlap.in_flight for s in step.scheduled.seqs}
        assert not in_flight & set(scheduled.seqs), "a sequence was scheduled while its step was in flight"
        seen_depth["max"] = max(seen_depth["max"], len(eng.overlap.in_flight) + 1)
        seen_depth["submitted"] += 1
        return submit(scheduled)

    eng.runner.submit = watched
    return seen_depth


def one_layer_draft(checkpoint_dir) -> dict:
    """A draft model that disagrees often (rejections), with KV of its own per sequence."""
    draft = checkpoint_dir("llama", num_hidden_layers=1)
    return {"proposer": {"name": "draft_model", "options": {"model": draft}}, "num_speculative_tokens": 3}


# The engines compared with one rank (ranks of one process group: one such engine at a time);
# a callable value is made from the checkpoint_dir fixture
CONFIGS = {"pp2": dict(pipeline_parallel_size=2),
           # swap preemption: the KV of a sequence not in flight goes to the host and back
           "pp2-async-swap": dict(pipeline_parallel_size=2, async_scheduling=True, preemption_mode="swap",
                                  num_swap_blocks=64),
           "pp2-ngram": dict(pipeline_parallel_size=2, speculative={"proposer": "ngram", "num_speculative_tokens": 3}),
           "pp2-draft": dict(pipeline_parallel_size=2, speculative=one_layer_draft),
           "tp2-pp2": dict(pipeline_parallel_size=2, tensor_parallel_size=2),
           "pp2-off": dict(pipeline_parallel_size=2, pipeline_in_flight=False)}


@pytest.fixture(scope="module")
def engines(llama_dir, checkpoint_dir) -> Iterator[Callable[[str], LLM]]:
    """``engines(name)``: one rank (``pp1``, the oracle), or one of CONFIGS, the one before shut down."""
    pp1, current = LLM(llama_dir, **ENGINE), {}

    def get(name: str) -> LLM:
        if name == "pp1":
            return pp1
        if current.get("name") != name:
            if current:
                current.pop("llm").shutdown()
            config = {k: v(checkpoint_dir) if callable(v) else v for k, v in CONFIGS[name].items()}
            current["llm"] = llm = LLM(llama_dir, **ENGINE, **config)
            current["name"], llm.depth = name, watch_steps(llm) if llm.engine.overlap else None
        return current["llm"]

    yield get
    for llm in (pp1, current.get("llm")):
        if llm is not None:
            llm.shutdown()


def mixed_params(stops: list[str]) -> list[SamplingParams]:
    out = []
    for i in range(len(PROMPTS)):
        p = dict(temperature=0.0, max_tokens=6 + 5 * (i % 4), ignore_eos=True, logprobs=2)
        if i == 3:  # two samples, seeded
            p.update(n=2, temperature=1.0, seed=11)
        if i % 3 == 1:
            p["stop"] = stops
        if i in (2, 6, 9):  # 9: the longest prompt, cut in micro-batches
            p["prompt_logprobs"] = 2
        out.append(SamplingParams(**p))
    return out


def mixed_batch_identical_to_one_rank(engines, name: str) -> None:
    free = seen(engines("pp1").generate(PROMPTS, SamplingParams(temperature=0, max_tokens=21, ignore_eos=True),
                                        use_tqdm=False))
    stops = [t for o in free if (t := o[0][1][len(o[0][1]) // 2:len(o[0][1]) // 2 + 2]).strip()]
    params = mixed_params(stops)
    oracle = engines("pp1").generate(PROMPTS, params, use_tqdm=False)
    expected = seen(oracle)
    llm = engines(name)
    preempted = f"preemptions_{llm.engine.config.preemption_mode}"
    before = llm.engine.stats()[preempted]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert seen(outs) == expected
    same_logprobs(outs, oracle)
    assert same_prompt_logprobs(outs, oracle) >= 3 * 2
    assert llm.depth is None or llm.depth["max"] == 2, "never two steps in flight"
    assert any(c[2] == "stop" for o in expected for c in o) and len(expected[3]) == 2
    if llm.depth is not None:  # one step at a time needs fewer blocks: no preemption there
        assert llm.engine.stats()[preempted] > before, f"the workload made no {preempted}"
    assert llm.engine.allocator.num_free_blocks() == llm.engine.allocator.num_blocks


def test_mixed_batch_identical_to_one_rank(engines):
    mixed_batch_identical_to_one_rank(engines, "pp2")


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
          "required": ["a", "b"], "additionalProperties": False}
STRUCTURED = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=60,
                            structured_outputs=StructuredOutputs(json=SCHEMA))


def structured_identical_to_one_rank(engines, name: str) -> None:
    expected = seen(engines("pp1").generate(PROMPTS[:4], STRUCTURED, use_tqdm=False))
    assert seen(engines(name).generate(PROMPTS[:4], STRUCTURED, use_tqdm=False)) == expected
    assert any(c[2] == "stop" for o in expected for c in o)  # finished by the grammar, at the same token


def test_structured_outputs(engines):
    structured_identical_to_one_rank(engines, "pp2")


def test_abort_mid_flight_frees_every_block(engines):
    eng = engines("pp2").engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:6]):
        eng.add_request(f"abort-{i}", p, params)
    for _ in range(6):
        eng.step()
    in_flight = {s.request_id for step in eng.overlap.in_flight for s in step.scheduled.seqs}
    assert in_flight, "no step in flight to abort from"
    victim = sorted(in_flight)[0]
    held = eng.allocator.num_free_blocks()
    assert eng.abort_request(victim).finished
    assert eng.allocator.num_free_blocks() == held, "an aborted sequence's blocks went back under its step in flight"
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id != victim, "an aborted request's tokens were shown"
    assert eng.allocator.num_free_blocks() == eng.allocator.num_blocks
    for i, p in enumerate(PROMPTS[:6]):  # and aborting everything at once, steps in flight
        eng.add_request(f"all-{i}", p, params)
    eng.step(), eng.step()
    assert eng.overlap.pending
    for i in range(6):
        eng.abort_request(f"all-{i}")
    while eng.has_unfinished_requests():
        assert eng.step() == []
    assert eng.allocator.num_free_blocks() == eng.allocator.num_blocks


def test_async_scheduling_on(engines):
    """Async scheduling's overlap is the pipeline's here (a step's outputs are processed while the
    later stages run the next): the same engine path, the same tokens."""
    mixed_batch_identical_to_one_rank(engines, "pp2-async-swap")


def test_swap_preemption_of_the_one_sequence_not_in_flight(engines):
    """Two long sequences, one per step in flight, outgrow the KV cache: the one the policy sees
    swaps itself out in a step that schedules nothing. Its KV must reach the host all the same
    (with the next step that runs): it comes back with the tokens of one rank."""
    prompts, params = PROMPTS[5:3:-1], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    expected = seen(engines("pp1").generate(prompts, params, use_tqdm=False))
    llm = engines("pp2-async-swap")
    sched, lone = llm.engine.scheduler, []
    step = sched.step

    def watched(*args):
        out = step(*args)
        lone.extend(out.preempted if not out.seqs else [])
        return out

    sched.step = watched
    try:
        assert seen(llm.generate(prompts, params, use_tqdm=False)) == expected
    finally:
        del sched.step
    assert lone, "no step swapped out its one sequence"


def test_stage_times_and_shutdown_with_steps_in_flight(engines):
    llm = engines("pp2-async-swap")
    eng = llm.engine
    pids = [p.pid for p in eng.executor.procs]
    llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    busy = eng.runner.stage_times()
    assert len(busy) == 2 and all(b > 0 for b in busy), busy
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng.overlap.pending
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 20
    assert not eng.overlap.pending and not eng.scheduler.in_flight
    assert all(not os.path.exists(f"/proc/{pid}") for pid in pids), "a worker outlived the shutdown"
    for i in range(len(PROMPTS)):  # what the server does with requests left at shutdown
        eng.abort_request(f"r{i}")
    assert eng.allocator.num_free_blocks() == eng.allocator.num_blocks


def test_tp2_pp2_identical_to_one_rank(engines):
    """Four ranks: stage 0 is ranks 0-1, stage 1 ranks 2-3; rank 0's messages reach all three."""
    mixed_batch_identical_to_one_rank(engines, "tp2-pp2")


def test_tp2_pp2_structured_outputs(engines):
    """Rank 0 computes the grammar's bitmask; the logits come from the last stage's TP rank 0."""
    structured_identical_to_one_rank(engines, "tp2-pp2")


def test_one_step_at_a_time_identical_to_one_rank(engines):
    """--no-pipeline-in-flight: the engine as before, steps one at a time."""
    mixed_batch_identical_to_one_rank(engines, "pp2-off")
    assert engines("pp2-off").engine.overlap is None


@pytest.fixture(scope="module")
def spec_workload(engines) -> tuple[list[str], list[SamplingParams], list]:
    """Greedy prompts (one that repeats itself: ngram drafts) with stop strings, logprobs and
    prompt logprobs, and what one rank without speculation makes of them."""
    prompts = [*PROMPTS, "a b c d e f a b c d e f a b c"]
    free = seen(engines("pp1").generate(prompts, SamplingParams(temperature=0, max_tokens=21, ignore_eos=True),
                                        use_tqdm=False))
    stops = [t for o in free if (t := o[0][1][len(o[0][1]) // 2:len(o[0][1]) // 2 + 2]).strip()]
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * (i % 4), ignore_eos=True, logprobs=2,
                             stop=stops if i % 3 == 1 else None, prompt_logprobs=2 if i % 4 == 2 else None)
              for i in range(len(prompts))]
    return prompts, params, engines("pp1").generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("name", ["pp2-ngram", "pp2-draft"])
def test_speculative_decoding_in_flight(engines, spec_workload, name):
    """Each step's drafts are proposed from its sequences' applied tokens (none of them is in
    another step in flight) and verified on the last stage's logits: the tokens of one rank
    without speculation, with preemption (recompute) and prompt logprobs on the way."""
    prompts, params, oracle = spec_workload
    llm = engines(name)
    assert isinstance(llm.engine.overlap, PipelinedSteps)
    before = llm.engine.stats()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert seen(outs) == seen(oracle)
    same_logprobs(outs, oracle)
    assert same_prompt_logprobs(outs, oracle) > 0
    stats = {k: v - before[k] for k, v in llm.engine.stats().items() if k.startswith(("spec_", "preemptions_"))}
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], "no draft accepted, or none rejected"
    assert stats["preemptions_recompute"] > 0, "the workload preempted nothing"
    assert llm.depth["max"] == 2, "never two steps in flight"
    assert llm.engine.allocator.num_free_blocks() == llm.engine.allocator.num_blocks


# -- the scheduler's side, without processes ------------------------------------------------
def core(depth: int = 2, blocks: int = 64) -> tuple[SchedulerCore, PagedAllocator]:
    limits = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64)
    alloc = PagedAllocator(num_blocks=blocks, block_size=4, max_model_len=64)
    sched = SchedulerCore(FCFSScheduler(limits), alloc, limits, "fcfs")
    sched.pipeline_depth = depth
    return sched, alloc


def decoding(sched: SchedulerCore, n: int) -> list[Sequence]:
    """``n`` sequences, prefilled and each with a sampled token: running decodes."""
    seqs = [Sequence(i, f"r{i}", [5, 6, 7 + i], 3, SP(), 0.0) for i in range(n)]
    for s in seqs:
        sched.add(s)
    step = sched.step()
    for s, k in zip(step.seqs, step.num_new_tokens):
        s.num_computed_tokens += k
        s.token_ids.append(1)
    sched.settled(step)
    return seqs


def test_steps_in_flight_are_disjoint_and_share_the_decodes():
    sched, _ = core()
    seqs = decoding(sched, 6)
    first = sched.step()
    second = sched.step()
    assert len(first.seqs) == len(second.seqs) == 3, "the decodes split in two halves"
    assert not set(first.seqs) & set(second.seqs)
    assert sched.step().seqs == [], "every sequence is in flight: nothing to schedule"
    sched.settled(first)
    assert set(sched.step().seqs) == set(first.seqs)
    assert sched.in_flight == set(seqs)


def test_one_step_at_a_time_hides_nothing():
    sched, _ = core(depth=1)
    seqs = decoding(sched, 6)
    assert sched.step().seqs == seqs and not sched.in_flight


class EveryRunning(Scheduler):
    """A planted fault: schedules every running sequence, in flight or not."""

    def __init__(self, running: list[Sequence]) -> None:
        super().__init__(SchedulerLimits(8, 256, 64))
        self.all = running

    def schedule(self, view) -> Schedule:
        return Schedule({s: 1 for s in self.all})


def test_a_sequence_in_flight_is_refused():
    sched, _ = core()
    seqs = decoding(sched, 4)
    sched.step()
    sched.policy = EveryRunning(seqs)
    with pytest.raises(PluginError, match="in a step still in flight"):
        sched.step()


def test_an_ended_sequence_keeps_its_blocks_until_its_step_settles():
    sched, alloc = core()
    seqs = decoding(sched, 4)
    step = sched.step()
    victim = step.seqs[0]
    free = alloc.num_free_blocks()
    sched.finish(victim, "abort")
    assert alloc.num_free_blocks() == free, "freed under its step in flight"
    assert victim.is_finished and victim not in sched.running
    sched.settled(step)
    assert alloc.num_free_blocks() == free + 1
    for s in seqs[1:]:
        sched.finish(s, "abort")
    assert alloc.num_free_blocks() == alloc.num_blocks


def test_a_swap_out_of_a_step_that_never_runs_goes_with_the_next():
    """Steps in flight hold blocks the policy does not see: the one sequence it sees may have to
    preempt itself (swap), and that step schedules nothing, so it never runs. Its copies to the
    host go with the next step that runs, ahead of that step's forward (which may reuse the
    blocks), else the sequence would come back with KV never saved."""
    limits = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64)
    alloc = PagedAllocator(num_blocks=3, block_size=4, max_model_len=64)
    sched = SchedulerCore(FCFSScheduler(limits), alloc, limits, "fcfs", "swap", SwapSpace(8))
    sched.pipeline_depth = 2
    a, b = seqs = [Sequence(i, f"r{i}", [5, 6, 7, 8 + i], 4, SP(), 0.0) for i in range(2)]
    for s in seqs:  # prompts of one full block each, then a sampled token: each decode needs a block
        sched.add(s)
    prefill = sched.step()
    for s in seqs:
        s.num_computed_tokens = 4
        s.token_ids.append(1)
    sched.settled(prefill)
    first = sched.step()
    assert first.seqs == [a] and alloc.num_free_blocks() == 0
    (block,) = b.block_ids
    lone = sched.step()
    assert lone.seqs == [] and lone.preempted == [b] and b.status is SequenceStatus.SWAPPED
    a.num_computed_tokens = 5  # its step applied
    a.token_ids.append(1)
    sched.settled(first)
    nxt = sched.step()
    assert nxt.seqs == [a], "a step that runs"
    assert [d for d, _ in nxt.swap_out] == [block], "the lone step's swap-out was lost"
    assert sched.step().swap_out == [], "a swap-out sent twice"


def test_the_flag_turns_it_off(llama_dir):
    from modserve import cli

    for argv, on in (([], True), (["--no-pipeline-in-flight"], False), (["--pipeline-in-flight"], True)):
        args = cli.build_parser().parse_args(["serve", llama_dir, "-pp", "2", *argv])
        assert cli.config_from_args(args).pipeline_in_flight is on


def test_idle_fractions_per_stage():
    """Stage i's busy time is its tensor-parallel rank 0's (global rank i x tp)."""
    from modserve.bench.bubble import StageClock, bubble_line, idle_fractions

    start, end = StageClock([1.0, 1.0, 2.0, 2.0], 10.0), StageClock([4.0, 3.9, 3.0, 3.1], 14.0)
    assert idle_fractions(start, end, 2) == pytest.approx([0.25, 0.75])
    assert "stage 0 25%, stage 1 75%" in bubble_line([0.25, 0.75], True)
