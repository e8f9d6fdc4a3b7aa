"""Executor: an engine of two tensor-parallel ranks through it answers as one rank does, and its
worker neither dies unnoticed nor outlives ``engine.shutdown()``.

Engines of the tiny Llama, float32, one thread per rank (:mod:`.tp_engines`); the kit finds
each worker's process through a sampler it registers as a module plugin
(:mod:`.executor_probe`). An executor that runs one rank only (``uni``) must refuse more with
a clear ``ValueError``; the checks of two ranks are skipped for it. Each engine start costs
seconds (the workers import torch); the built-in ray's engines share one local cluster
(:func:`.tp_engines.shared_cluster`).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Iterator

import pytest

from modserve.engine.engine import EngineDeadError
from modserve.core.sampling_params import SamplingParams
from modserve.testing.conformance.targets import Implementation
from modserve.testing.conformance.tp_engines import (
    PROMPTS, STEP_WITHIN, TP, Ranks, describe, generate, one_rank_tokens, shared_cluster, start,
    wait_gone, within,
)

CONFORMANCE_KIND = "executor"
pytestmark = pytest.mark.usefixtures("modserve_one_thread")

FAILED_WITHIN = 10.0  # seconds after a worker's SIGKILL until failed() must say so
POLL_BUDGET = 0.05  # seconds one failed() call may take: the engine polls it
GONE_WITHIN = 2.0  # seconds after shutdown() returned for a process manager (Ray's raylet) to reap


@pytest.fixture(scope="module")
def one_rank() -> list[list[int]]:
    return one_rank_tokens()


@pytest.fixture(scope="module", autouse=True)
def cluster(implementation: Implementation) -> Iterator[None]:
    """What an executor's engines may share across the module (the built-in ray's one cluster)."""
    with shared_cluster(implementation):
        yield


@pytest.fixture(scope="module")
def ranks(implementation: Implementation, cluster: None) -> Iterator[Ranks]:
    """One engine of two ranks, shared by the checks of a healthy engine; the last one shuts it down."""
    made = start(implementation)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def own_ranks() -> Iterator[list[Ranks]]:
    """Engines of the test's own (``own_ranks.append(start(...))``), closed after it."""
    made: list[Ranks] = []
    try:
        yield made
    finally:
        for r in made:
            r.close()


def test_tp2_gives_the_greedy_tokens_of_one_rank(implementation: Implementation, ranks: Ranks,
                                                 one_rank: list[list[int]]) -> None:
    """``start(workers)`` runs ``run_worker(spec)`` for each rank > 0 as given: the engine of two
    ranks gives the greedy tokens of an engine of one."""
    engine = ranks.require()
    got = generate(engine)
    for i, (a, b) in enumerate(zip(got, one_rank)):
        assert a == b, (f"prompt {i} ({len(PROMPTS[i])} tokens): {TP} ranks through {implementation} gave {a}, one "
                        f"rank {b}: the workers must run the spec they are given (its config, plugins and env)")
    ranks.workers()  # and each rank had a process of its own


def test_failed_is_none_and_quick_while_healthy(implementation: Implementation, ranks: Ranks) -> None:
    """``failed()`` is None while every worker runs, and never blocks: the engine polls it
    (at start, after a failed step, once a second in the server's idle loop)."""
    engine = ranks.require()
    generate(engine, PROMPTS[:1], 2, tag="healthy")
    for i in range(20):
        began = time.perf_counter()
        why = engine.executor.failed()
        took = time.perf_counter() - began
        assert why is None, f"failed() call {i + 1} said {why!r} while every worker runs: it must return None"
        assert took < POLL_BUDGET, (f"failed() call {i + 1} took {took * 1000:.0f} ms: it is polled, so it must "
                                    f"answer at once (under {POLL_BUDGET * 1000:.0f} ms), not wait for the workers")


def test_shutdown_leaves_no_worker(implementation: Implementation, ranks: Ranks) -> None:
    """After ``engine.shutdown()`` (rank 0 told the workers to stop, then ``Executor.shutdown()``)
    no worker process is left: neither running nor a zombie nobody reaped."""
    engine = ranks.require()
    generate(engine, PROMPTS[:1], 2, tag="before-shutdown")
    pids = ranks.workers()
    took = ranks.shutdown()
    left = wait_gone(pids, GONE_WITHIN)
    assert not left, (f"engine.shutdown() returned after {took:.1f} s; {GONE_WITHIN:g} s later its worker processes "
                      f"are still there: {'; '.join(describe(p) for p in left)}. Executor.shutdown() must end and "
                      f"reap every worker: no process may outlive it")


def test_shutdown_ends_a_worker_that_does_not_exit(implementation: Implementation,
                                                   own_ranks: list[Ranks]) -> None:
    """A worker that does not exit once told to stop (a plugin left a thread running, here the
    kit's probe) is still ended by ``shutdown()``: it waits a little, then kills what is left,
    all within SHUTDOWN_WITHIN seconds."""
    ranks = start(implementation, linger=True)
    own_ranks.append(ranks)
    engine = ranks.require()
    generate(engine, PROMPTS[:1], 2, tag="lingering")
    pids = ranks.workers()
    took = ranks.shutdown()  # fails past SHUTDOWN_WITHIN
    left = wait_gone(pids, GONE_WITHIN)
    assert not left, (f"engine.shutdown() returned after {took:.1f} s leaving workers that did not exit by themselves "
                      f"once told to stop: {'; '.join(describe(p) for p in left)}. Executor.shutdown() must wait "
                      f"a little, then kill what is left")


def test_a_killed_worker_is_reported_and_ends_the_engine(implementation: Implementation,
                                                         own_ranks: list[Ranks]) -> None:
    """A worker SIGKILLed between steps: ``failed()`` says why (a non-empty reason) within
    FAILED_WITHIN seconds, the next step raises ``EngineDeadError``, and ``shutdown()`` then
    returns within SHUTDOWN_WITHIN seconds leaving no process."""
    ranks = start(implementation)
    own_ranks.append(ranks)
    engine = ranks.require()
    generate(engine, PROMPTS[:1], 2, tag="before-kill")
    pids = ranks.workers()
    assert engine.executor.failed() is None, "failed() must be None while every worker runs"
    os.kill(pids[0], signal.SIGKILL)
    killed, deadline = time.monotonic(), time.monotonic() + FAILED_WITHIN
    while (why := engine.executor.failed()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert why is not None, (f"failed() still returned None {FAILED_WITHIN:g} s after the worker's process "
                             f"(pid {pids[0]}) was SIGKILLed: it must say why a worker is gone, or the engine "
                             f"steps into a dead group")
    assert isinstance(why, str) and why.strip(), f"failed() must return a non-empty reason, got {why!r}"
    seen_after = time.monotonic() - killed

    def step() -> None:
        engine.add_request("after-kill", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        engine.step()

    try:
        within(STEP_WITHIN, step, "the step after a worker died")
    except EngineDeadError:
        pass
    except pytest.fail.Exception:
        raise  # it hung
    except Exception as e:  # noqa: BLE001 - any other error is the finding
        pytest.fail(f"the step after the worker died (failed() said so after {seen_after:.1f} s: {why!r}) raised "
                    f"{type(e).__name__}: {e}; it must raise EngineDeadError")
    else:
        pytest.fail(f"the step after the worker died (failed() said so after {seen_after:.1f} s: {why!r}) did not "
                    f"raise; it must raise EngineDeadError")
    took = ranks.shutdown()
    left = wait_gone(pids, GONE_WITHIN)
    assert not left, (f"engine.shutdown() after a worker died returned after {took:.1f} s leaving "
                      f"{'; '.join(describe(p) for p in left)}")


def test_one_rank_executor_refuses_more_ranks_clearly(implementation: Implementation, ranks: Ranks) -> None:
    """An executor that runs fewer ranks than asked (``uni``: the engine's own only) refuses at
    start with a ValueError that names the ranks asked for and the setting to change, and
    leaves no process. Skipped for one that ran two ranks."""
    if ranks.engine is not None:
        pytest.skip(f"{implementation} runs {TP} ranks")
    e = ranks.error
    assert isinstance(e, ValueError), (
        f"an engine of {TP} ranks through {implementation} did not start: {type(e).__name__}: {e}. An executor that "
        f"cannot run {TP} ranks must refuse with a ValueError (a configuration error) saying so")
    text = str(e)
    assert str(TP) in text and any(s in text for s in ("tensor_parallel_size", "distributed_executor_backend")), (
        f"the refusal must name the {TP} ranks asked for and the setting to change (tensor_parallel_size, "
        f"distributed_executor_backend); it says: {text}")
    workers = [int(p.name) for p in ranks.folder.iterdir() if p.name.isdigit() and int(p.name) != os.getpid()]
    left = wait_gone(workers, GONE_WITHIN)
    assert not left, f"the refused start left processes: {'; '.join(describe(p) for p in left)}"
