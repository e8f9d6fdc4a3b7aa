"""The mp executor and the front ends around it: tensor-parallel workers that answer as
TP=1 does, and that neither outlive the server or the LLM nor die unnoticed.

- Servers (``modserve serve --tensor-parallel-size 2``, real processes, the official openai
  client): one answers as offline TP=1 does, shrugs off the SIGINT a terminal's Ctrl-C sends
  its workers, and leaves no process after SIGTERM; another has its worker SIGKILLed in the
  middle of a stream: the client gets an error at once, /health 503, and nothing is left.
- The server's engine loop in-process (a TP=1 engine told its worker died): the idle loop
  notices within its one-second health check; a dead step fails every request in flight.
- Offline: ``with LLM(..., tensor_parallel_size=2)`` answers as TP=1 and stops its worker;
  a worker killed between steps is an EngineDeadError naming the rank and the signal; a
  worker failing at start fails the start; an LLM dropped or left at exit stops its engine.
- The executor alone: a worker whose driver is SIGKILLed before it joined ends (watchdog),
  one that never stops is killed by shutdown(), and failed() never blocks.

Each TP=2 start costs 10-20 s here (the workers import torch and modserve); the tests use
the tiny llama, one thread per rank, and a small KV cache.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types
from contextlib import contextmanager

import httpx
import openai
import pytest

from modserve import LLM, SamplingParams
from modserve.api import WorkerSpec
from modserve.core.config import EngineConfig
from modserve.engine.engine import EngineDeadError, LLMEngine
from modserve.core.registry import Registry
from modserve.plugins.executors.mp import MultiprocessExecutor, MultiprocessOptions
from modserve.server.async_engine import AsyncEngine, EngineDead, EngineStopped
from processes import alive, descendants, wait_until
from server_process import launch, stop, stop_all, wait_healthy

MODEL = "tiny"
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(3)]
MAX_TOKENS = 12
ENGINE = dict(num_threads=1, num_kv_blocks=64, max_model_len=512, progress=False)
SERVER_FLAGS = ["--served-model-name", MODEL, "--num-threads", "1", "--num-kv-blocks", "64",
                "--max-model-len", "512"]
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
LONG = dict(temperature=0.0, max_tokens=300, extra_body={"ignore_eos": True})  # seconds of tokens at TP=2


# -- processes, seen through /proc (tests/processes.py) -------------------------------------
def workers_of(pid: int) -> list[int]:
    """The spawned tensor-parallel workers below ``pid`` (not multiprocessing's resource tracker)."""
    return [p for p, cmd in descendants(pid).items() if "spawn_main" in cmd]


def assert_all_gone(pids, timeout: float = 10.0) -> None:
    assert wait_until(lambda: not any(alive(p) for p in pids), timeout), \
        {p: descendants(1).get(p, "?") for p in pids if alive(p)}


@contextmanager
def deadline(seconds: float):
    """A TimeoutError in this (the main) thread after ``seconds``: a hang fails the test."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def reference(llama_dir) -> list[str]:
    """TP=1's greedy texts, offline."""
    with LLM(llama_dir, **ENGINE) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


# -- a TP=2 server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(llama_dir, tmp_path_factory):
    """The module's two TP=2 servers, their starts overlapping: ``tp2`` for the tests of a healthy
    one, and ``doomed``, whose worker test_a_killed_worker_... kills. ``doomed`` stays up answering
    503 (else it exits 1 once nothing runs: a race with that test's checks)."""
    tmp = tmp_path_factory.mktemp("tp2")
    flags = [llama_dir, "--tensor-parallel-size", "2", *SERVER_FLAGS]
    started = {"tp2": launch(tmp, "tp2", *flags), "doomed": launch(tmp, "doomed", *flags, "--no-exit-on-engine-death")}
    try:
        for s in started.values():
            wait_healthy(s, timeout=180)
        yield started
    finally:
        stop_all(*started.values())


@pytest.fixture(scope="module")
def server(servers):
    return servers["tp2"]


def test_a_tp2_server_answers_as_tp1_does(server, reference):
    assert len(workers_of(server.proc.pid)) == 1  # -tp 2: one worker beside the server's own rank
    client = server.client()
    r = client.completions.create(model=MODEL, prompt=PROMPTS, **GREEDY)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == reference
    streamed = "".join(chunk.choices[0].text for chunk in
                       client.completions.create(model=MODEL, prompt=PROMPTS[1], stream=True, **GREEDY)
                       if chunk.choices)
    assert streamed == reference[1]


def test_the_terminals_sigint_does_not_reach_past_the_engine(server, reference):
    """Ctrl-C signals the terminal's whole process group: the workers must leave their end to
    the engine (which drains first), not die under a request in flight."""
    client = server.client()
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **LONG)
    next(iter(stream))
    for pid in workers_of(server.proc.pid):
        os.kill(pid, signal.SIGINT)
    finish = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]
    assert finish[-1] == "length"
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = client.completions.create(model=MODEL, prompt=PROMPTS, **GREEDY)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == reference


def test_sigterm_stops_every_worker_before_the_server_exits(server):
    tree = descendants(server.proc.pid)
    [worker] = workers_of(server.proc.pid)
    assert stop(server) == 0
    assert_all_gone(tree)
    # told to stop and reaped by the server (exit 0), not ended by interpreter exit's SIGTERM
    assert f"rank 1 (pid {worker}) ended with exit code 0" in server.log.read_text()


def test_a_killed_worker_fails_the_stream_in_flight_and_the_server_reports_it(servers):
    server = servers["doomed"]
    try:
        tree = descendants(server.proc.pid)
        [worker] = workers_of(server.proc.pid)
        client = server.client()
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **LONG)
        next(iter(stream))
        start = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(openai.APIError) as error:
            for chunk in stream:
                assert not chunk.choices or chunk.choices[0].finish_reason is None, "the stream finished"
        assert time.monotonic() - start < 10
        assert "the engine stopped" in str(error.value) and error.value.code == "engine_dead"
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead", health.text
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY)
        assert refused.value.status_code == 503 and refused.value.code == "engine_dead"
        assert stop(server) == 0
        assert_all_gone(tree)
    finally:
        stop(server)
    log = server.log.read_text()
    assert f"engine dead: a tensor-parallel worker failed: rank 1 (pid {worker}) ended with signal SIGKILL" in log
    assert "one at a time to find the culprit" not in log  # no request was blamed for it


# -- the server's engine loop, in-process ------------------------------------------------------
def test_the_idle_engine_loop_notices_a_dead_worker(llama_dir, monkeypatch):
    """A worker that dies between requests: the idle loop's health check (once a second)
    stops the engine; then a request is refused, and stats() does not hang."""
    engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, max_model_len=256), progress=False)
    why = {"failed": None}
    monkeypatch.setattr(engine.executor, "failed", lambda: why["failed"])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            async for out in ae.submit([PROMPTS[0]], params):
                pass
            assert out.finished and ae.alive
            await asyncio.sleep(1.5)  # idle past a health check: still fine
            assert ae.alive
            why["failed"] = "rank 1 (pid 4242) ended with signal SIGKILL"
            start = time.monotonic()
            while ae.alive:
                assert time.monotonic() - start < 5, "an idle engine missed its dead worker"
                await asyncio.sleep(0.05)
            assert ae.dead_reason == "a tensor-parallel worker failed: rank 1 (pid 4242) ended with signal SIGKILL"
            with pytest.raises(EngineDead, match="a tensor-parallel worker failed"):
                ae.submit([PROMPTS[0]], params)
            await asyncio.wait_for(ae.stats(), 5)
        finally:
            ae.stop()

    asyncio.run(main())


def test_a_dead_worker_fails_the_requests_in_flight(llama_dir, monkeypatch):
    engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, max_model_len=256), progress=False)
    real_step, steps = engine.step, {"n": 0}

    def step():
        steps["n"] += 1
        if steps["n"] == 3:
            raise EngineDeadError("a tensor-parallel worker failed: rank 1 (pid 4242) ended with exit code 1")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            streams = [ae.submit([p], params) for p in PROMPTS]
            for stream in streams:
                with pytest.raises(EngineStopped, match="rank 1 \\(pid 4242\\) ended with exit code 1"):
                    async for _ in stream:
                        pass
            await asyncio.sleep(0.1)
            assert not ae.alive and ae.num_in_flight == 0
        finally:
            ae.stop()

    asyncio.run(main())
    assert not engine.requests  # the loop aborted them on its way out


# -- offline -----------------------------------------------------------------------------------
def test_offline_tp2_answers_as_tp1_and_its_with_block_stops_the_workers(llama_dir, reference, caplog):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="modserve"):
        with LLM(llama_dir, tensor_parallel_size=2, **ENGINE) as llm:
            assert [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)] == reference
            [worker] = multiprocessing.active_children()
            pid = worker.pid
        assert multiprocessing.active_children() == [] and not alive(pid)
    assert f"rank 1 (pid {pid}) ended with exit code 0" in caplog.text  # told to stop, not killed
    with pytest.raises(RuntimeError, match="this LLM was shut down"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    llm.shutdown()  # twice is fine


def test_offline_tp2_fails_cleanly_when_a_worker_is_killed_between_steps(llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(llama_dir, tensor_parallel_size=2, **ENGINE) as llm:
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
        [worker] = multiprocessing.active_children()
        os.kill(worker.pid, signal.SIGKILL)
        assert wait_until(lambda: worker.exitcode is not None, 10)  # dead (and reaped) between steps
        with deadline(30), pytest.raises(EngineDeadError) as error:
            llm.generate(PROMPTS, params, use_tqdm=False)
        assert str(error.value) == \
            f"a tensor-parallel worker failed: rank 1 (pid {worker.pid}) ended with signal SIGKILL"
        assert not llm.engine.requests
    assert multiprocessing.active_children() == []


def test_an_llm_dropped_or_left_at_exit_stops_its_engine(llama_dir, monkeypatch):
    stopped = []
    monkeypatch.setattr(LLMEngine, "shutdown", lambda self: stopped.append(self))
    with LLM(llama_dir, num_kv_blocks=64, max_model_len=256, progress=False) as llm:
        pass
    assert stopped == [llm.engine]
    stopped.clear()
    llm = LLM(llama_dir, num_kv_blocks=64, max_model_len=256, progress=False)
    engine, finalizer = llm.engine, llm._finalizer
    assert finalizer.atexit  # one left alive at exit is stopped then
    del llm
    gc.collect()
    assert stopped == [engine] and not finalizer.alive


def test_a_worker_failing_at_start_fails_the_start_quickly(llama_dir, capfd):
    registry = Registry()
    registry.load_entrypoints({"modserve"})
    # Registered here as a module: each worker imports it by name, and there is no such module.
    registry.add_plugin(types.ModuleType("modserve_no_such_worker_plugin"), "modserve_no_such_worker_plugin")
    start = time.monotonic()
    with deadline(90), pytest.raises(RuntimeError, match=r"a worker failed before joining: rank 1 \(pid \d+\) "
                                                        r"ended with exit code 1"):
        LLM(llama_dir, tensor_parallel_size=2, registry=registry, **ENGINE)
    assert time.monotonic() - start < 60
    assert multiprocessing.active_children() == []
    assert "No module named 'modserve_no_such_worker_plugin'" in capfd.readouterr().err


# -- the executor alone --------------------------------------------------------------------------
def unjoinable_spec(llama_dir) -> WorkerSpec:
    """A rank 1 whose rank 0 never listens: it starts, then waits to join, alive, until killed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = EngineConfig(model=llama_dir, num_threads=1, tensor_parallel_size=2).model_dump()
    return WorkerSpec(config, 1, 2, f"tcp://127.0.0.1:{port}", "gloo", ["modserve"],
                      {"MODSERVE_LOAD_PLUGINS": "modserve"})


def test_shutdown_kills_a_worker_that_does_not_stop_and_failed_never_blocks(llama_dir):
    executor = MultiprocessExecutor(MultiprocessOptions(stop_timeout=1))
    executor.start([unjoinable_spec(llama_dir)])
    pid = executor.procs[0].pid
    try:
        for _ in range(3):
            start = time.perf_counter()
            assert executor.failed() is None
            assert time.perf_counter() - start < 0.05
        start = time.monotonic()
        executor.shutdown()
        assert time.monotonic() - start < 5
        assert not alive(pid) and executor.procs == []
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


DRIVER = textwrap.dedent("""
    import sys, time
    from modserve.api import WorkerSpec
    from modserve.core.config import EngineConfig
    from modserve.plugins.executors.mp import MultiprocessExecutor

    if __name__ == "__main__":  # the spawned worker imports this file again
        model, port = sys.argv[1], int(sys.argv[2])
        config = EngineConfig(model=model, num_threads=1, tensor_parallel_size=2).model_dump()
        executor = MultiprocessExecutor()
        executor.start([WorkerSpec(config, 1, 2, f"tcp://127.0.0.1:{port}", "gloo", ["modserve"], {})])
        print(executor.procs[0].pid, flush=True)
        time.sleep(600)
""")


def test_a_worker_does_not_outlive_a_killed_driver(llama_dir, tmp_path):
    """The driver SIGKILLed while its worker still starts (no group to break yet): the
    worker's watchdog sees it re-parented and ends it."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    port = int(unjoinable_spec(llama_dir).init_method.rpartition(":")[2])
    driver = subprocess.Popen([sys.executable, str(script), llama_dir, str(port)], stdout=subprocess.PIPE,
                              text=True)
    worker = None
    try:
        worker = int(driver.stdout.readline())
        tree = descendants(driver.pid)
        assert worker in tree
        driver.kill()
        driver.wait()
        assert_all_gone(tree, timeout=20)
    finally:
        driver.kill()
        driver.wait()
        if worker and alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_rank0_failing_inside_a_step_the_worker_runs_too_ends_the_engine_without_a_hang(llama_dir):
    """Rank 0 raises in a layer its worker also runs: the worker waits in an all-reduce rank 0
    will not join, so no retry may follow (the next broadcast would meet that all-reduce); the
    engine is dead at once, and shutting it down sends the worker nothing and leaves nothing."""
    import rank0_fault_plugin

    registry = Registry()
    registry.load_entrypoints()
    registry.add_plugin(rank0_fault_plugin, "rank0_fault_plugin")
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    with deadline(60):
        # stop_timeout 1: the worker, left in its all-reduce, is killed after 1 s rather than the default 10
        llm = LLM(llama_dir, tensor_parallel_size=2, attention_backend=rank0_fault_plugin.NAME, registry=registry,
                  distributed_executor_backend={"name": "mp", "options": {"stop_timeout": 1}}, **ENGINE)
        with pytest.raises(EngineDeadError, match="rank 0 failed in run_model while the other ranks ran it"):
            llm.generate([PROMPTS[0]], params, use_tqdm=False)
        pids = [w.pid for w in multiprocessing.active_children()]
        llm.shutdown()
    assert multiprocessing.active_children() == [] and not any(alive(pid) for pid in pids)


def test_shutdown_with_a_frozen_worker_ends_it_and_returns(llama_dir, monkeypatch):
    """A worker stopped dead (SIGSTOP) never takes rank 0's stop: shutdown gives up on the
    send, the executor kills it, and nothing is left; within the send's deadline plus the
    executor's stop_timeout, not never."""
    from modserve.runner import ranks

    monkeypatch.setattr(ranks, "STOP_SEND_TIMEOUT_S", 1.0)  # the send's deadline, 5 s: the give-up is the same at 1 s
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(llama_dir, tensor_parallel_size=2, distributed_executor_backend={"name": "mp", "options": {
        "stop_timeout": 2}}, **ENGINE)
    llm.generate(PROMPTS[:1], params, use_tqdm=False)
    [worker] = multiprocessing.active_children()
    pid = worker.pid
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    with deadline(60):
        llm.shutdown()
    assert time.monotonic() - start < 30
    assert multiprocessing.active_children() == [] and not alive(pid)
