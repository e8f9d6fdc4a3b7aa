"""Pipeline parallelism: PP=2 engines (and TP=2 x PP=2) against PP=1 and transformers.

``pipeline_parallel_size=2`` (the ``mp`` executor, gloo) on the tiny Llama (GQA: 4 heads, 2
KV heads) with 3 decoder layers, so the stages split unevenly: the default partition is
[2, 1], and [1, 2] is asked for explicitly. Each engine runs test_tensor_parallel's
workload once (8 prompts of different lengths submitted together, prefix caching, chunked
prefill, preemption); the tests compare what they recorded with a PP=1 engine's: the
same greedy tokens, logprobs within 1e-4, no KV block in use and no child process alive
after shutdown.

- the partition: rank 0 (stage 0) builds and caches only its layers (the others are
  placeholders with empty KV caches);
- micro-batches: 1 (the stages in turn), 2 (one per stage) and 3 (more than
  the stages) give the same tokens; rank 0's runner is watched (``split_batch``, in this
  process) to see that steps really were cut into that many;
- Qwen2 (q/k/v biases, tied embeddings: the last stage's LM head is the embedding, which
  only the first stage otherwise needs) at PP=2;
- TP=2 x PP=2: four processes, one engine;
- a bad ``pp_layer_partition`` (wrong sum, a stage of no layers) fails the start with a
  ValueError naming it, and leaves no process behind;
- greedy tokens at PP=2 equal transformers' ``generate`` on the same checkpoint.

Each PP engine start costs 5-15 s here (the workers import torch and modserve): the runs
are shared between the tests through a module-scoped cache, one thread per rank.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from modserve import LLM
from modserve.engine import engine
from modserve.runner import model_runner
from modserve.runner.batch import MICRO_BATCH_MIN_TOKENS, micro_batch_count
from modserve.testing import cached_checkpoint
from test_tensor_parallel import (
    ENGINE, LENGTHS, MAX_NEW, SECOND_NEW, Run, assert_engine_was_clean, assert_workload_exercised, max_logprob_diff,
    prompts_for, run_workload,
)

PP = 2
LAYERS = 3  # over 2 stages: uneven

# name -> how to get the checkpoint (the cache root as argument)
CHECKPOINTS = {
    "llama-gqa-3": lambda root: cached_checkpoint("llama", cache_dir=root, num_hidden_layers=LAYERS),
    "qwen2": lambda root: cached_checkpoint("qwen2", cache_dir=root),  # 2 layers: [1, 1]
}


@dataclass
class PPRun(Run):
    """A Run, and what rank 0 (the engine's process, stage 0) showed of its stage."""

    stage_layers: list[int] = field(default_factory=list)  # the decoder layers rank 0 runs
    cached_layers: list[int] = field(default_factory=list)  # those whose KV cache rank 0 holds (non-empty)
    placeholders: list[int] = field(default_factory=list)  # those rank 0's model holds as nn.Identity
    parts: Counter = field(default_factory=Counter)  # micro-batches in a run_model call on rank 0 -> calls


def run_engine(path: str, tp: int = 1, pp: int = 1, **overrides: Any) -> PPRun:
    """test_tensor_parallel's workload on one engine (its run_engine, plus a look at rank 0's
    stage and at how its steps were split)."""
    start = time.monotonic()
    parts: Counter = Counter()
    split = model_runner.split_batch

    def counting_split(*args, **kwargs):
        out = split(*args, **kwargs)
        parts[len(out)] += 1
        return out

    model_runner.split_batch = counting_split  # rank 0's runner runs in this process
    try:
        llm = LLM(path, **{**ENGINE, **overrides}, tensor_parallel_size=tp, pipeline_parallel_size=pp)
        try:
            runner = llm.engine.runner
            assert (runner.tp.size, runner.pp.size) == (tp, pp)
            stage_layers = list(runner.layers)
            cached_layers = [i for i, c in enumerate(runner.kv_caches) if c.numel()]
            placeholders = [i for i, m in enumerate(runner.model.layers) if isinstance(m, torch.nn.Identity)]
            fields = run_workload(llm)
        finally:
            llm.engine.shutdown()
    finally:
        model_runner.split_batch = split
    run = PPRun(**fields, children=[p.name for p in multiprocessing.active_children()],
                seconds=time.monotonic() - start, stage_layers=stage_layers, cached_layers=cached_layers,
                placeholders=placeholders, parts=parts)
    return run


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> str:
    return os.environ.get("MODSERVE_TEST_CACHE") or str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def runs(cache_root):
    """``runs(name, tp, pp, **overrides)``: the workload on that engine, each one run once."""
    done: dict[tuple, PPRun] = {}

    def get(name: str, tp: int = 1, pp: int = 1, **overrides: Any) -> PPRun:
        key = (name, tp, pp, tuple(sorted((k, str(v)) for k, v in overrides.items())))
        if key not in done:
            done[key] = run_engine(str(CHECKPOINTS[name](cache_root)), tp, pp, **overrides)
        return done[key]

    return get


def assert_same_as(one: PPRun, other: PPRun) -> None:
    """``other`` did the workload as ``one`` (PP=1) did, cleanly."""
    for run in (one, other):
        assert_engine_was_clean(run)
        assert_workload_exercised(run)
    assert other.tokens == one.tokens
    assert other.tokens2 == one.tokens2 == [t[:SECOND_NEW] for t in one.tokens]
    assert all(len(run.prompt_logprobs[i]) == LENGTHS[i] for run in (one, other) for i in run.prompt_logprobs)
    assert max_logprob_diff(one, other) < 1e-4


@pytest.mark.parametrize("partition,stage0", [(None, [0, 1]), ([1, 2], [0])], ids=["default-2-1", "explicit-1-2"])
def test_pp2_equals_pp1(runs, partition, stage0):
    one = runs("llama-gqa-3")
    two = runs("llama-gqa-3", pp=PP, **({"pp_layer_partition": partition} if partition else {}))
    assert_same_as(one, two)
    assert one.stage_layers == one.cached_layers == list(range(LAYERS)) and one.placeholders == []
    assert two.stage_layers == two.cached_layers == stage0, "rank 0 runs and caches stage 0's layers only"
    assert two.placeholders == [i for i in range(LAYERS) if i not in stage0]
    assert max(two.parts) == 1, f"auto split steps below {MICRO_BATCH_MIN_TOKENS} tokens a stage: {dict(two.parts)}"
    assert not one.parts, "PP=1 split a batch"


def test_micro_batches_do_not_change_tokens(runs):
    """1 micro-batch (each stage waits for the one before), 2 (one per stage) and 3 (more
    than the stages), asked for: the same tokens as auto's; every step cut into at most that many."""
    auto = runs("llama-gqa-3", pp=PP)
    by_count = {m: runs("llama-gqa-3", pp=PP, pipeline_micro_batches=m) for m in (1, PP, 3)}
    for m, run in by_count.items():
        assert_engine_was_clean(run)
        assert max(run.parts) == m, f"pipeline_micro_batches {m}: steps cut into {dict(run.parts)}"
        assert run.tokens == auto.tokens and run.tokens2 == auto.tokens2, f"{m} micro-batches"
        assert max_logprob_diff(auto, run) < 1e-4
    assert_same_as(runs("llama-gqa-3"), by_count[3])


def test_auto_cuts_a_step_once_each_stage_gets_enough_tokens():
    """A decode step (16 sequences) stays whole: its micro-batches would each re-read the
    weights; a prefill of 1,024 tokens is cut in one micro-batch per stage."""
    assert micro_batch_count(None, 2, 16) == 1
    assert micro_batch_count(None, 2, 2 * MICRO_BATCH_MIN_TOKENS - 1) == 1
    assert micro_batch_count(None, 2, 2 * MICRO_BATCH_MIN_TOKENS) == 2
    assert micro_batch_count(None, 4, 1024) == 4 and micro_batch_count(None, 2, 1024) == 2
    assert micro_batch_count(3, 2, 16) == 3  # asked for: always


def test_qwen2_pp2_equals_pp1(runs):
    """Biases on q/k/v, and a tied LM head: stage 1 must load the embedding for its head."""
    one, two = runs("qwen2"), runs("qwen2", pp=PP)
    assert_same_as(one, two)
    assert two.stage_layers == [0] and two.placeholders == [1]


def test_tp2_pp2_equals_pp1(runs):
    """4 ranks: stage 0 is ranks 0-1 (layers 0-1), stage 1 ranks 2-3 (layer 2); each stage's
    two ranks hold one of the 2 KV heads."""
    one, four = runs("llama-gqa-3"), runs("llama-gqa-3", tp=2, pp=PP)
    assert_same_as(one, four)
    assert four.stage_layers == [0, 1]


@pytest.mark.parametrize("partition", [[1, 1], [3, 0], [1, 1, 1]], ids=["wrong-sum", "zero-layers", "wrong-length"])
def test_a_bad_partition_fails_the_start(cache_root, partition, monkeypatch):
    """The config's error, as a ValueError naming it, however fast the workers are: with a
    long WORKER_EXIT_GRACE rank 0 sees a worker that failed on it too exit first (on a busy
    rank 0 it does anyway), and must not make it an EngineDeadError of a 'failed worker'."""
    monkeypatch.setattr(engine, "WORKER_EXIT_GRACE", 5.0)
    path = str(CHECKPOINTS["llama-gqa-3"](cache_root))
    with pytest.raises(ValueError, match=r"pp_layer_partition \[.*\] must give each of 2 stages at least one "
                                         r"layer, 3 in all"):
        LLM(path, **ENGINE, pipeline_parallel_size=PP, pp_layer_partition=partition)
    assert multiprocessing.active_children() == [], "a worker outlived the failed start"


def test_pp2_greedy_matches_transformers(runs, cache_root):
    from transformers import AutoModelForCausalLM

    path = str(CHECKPOINTS["llama-gqa-3"](cache_root))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.num_hidden_layers == LAYERS
    expected = []
    with torch.no_grad():
        for p in prompts_for(model.config.vocab_size):
            gen = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=0)
            expected.append(gen[0, len(p):].tolist())
    assert runs("llama-gqa-3", pp=PP).tokens == expected
