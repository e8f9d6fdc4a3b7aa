"""Engines of two tensor-parallel ranks for the executor kit, and the worker processes they have.

Each engine serves the tiny Llama (:func:`modserve.testing.cached_checkpoint`) in float32, one
thread per rank, through the executor under test, its sampler the kit's probe
(:mod:`.executor_probe`), which tells the kit each worker's process id. Whatever might hang
(a step, ``shutdown()``) runs in a thread the kit waits for with a deadline: a hang fails
the test instead of the run. What the kit started it ends: leftover workers on this machine
are SIGKILLed after each test.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from modserve.core.config import EngineConfig
from modserve.engine.engine import LLMEngine
from modserve.core.registry import Registry, get_registry
from modserve.core.sampling_params import SamplingParams
from modserve.testing import cached_checkpoint
from modserve.testing.conformance import executor_probe as probe
from modserve.testing.conformance.targets import Implementation

TP = 2
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(3)]  # 5, 8 and 11 tokens
MAX_TOKENS = 8
ENGINE: dict[str, Any] = dict(dtype="float32", num_threads=1, num_kv_blocks=64, max_model_len=256)
SHUTDOWN_WITHIN = 30.0  # seconds engine.shutdown() may take, a worker that does not stop included
STEP_WITHIN = 30.0  # seconds a step may take once a worker is dead (it raises EngineDeadError)
PIDS_WITHIN = 10.0  # seconds for every worker's probe file to appear after the first step


def config(**overrides: Any) -> EngineConfig:
    return EngineConfig(model=str(cached_checkpoint("llama", "tiny")), **{**ENGINE, **overrides})


def generate(engine: LLMEngine, prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS,
             tag: str = "conformance") -> list[list[int]]:
    """Greedy tokens of each prompt, the requests submitted together and stepped to the end."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    done: dict[str, list[int]] = {}
    try:
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
    finally:
        abort_all(engine)
    return [done[rid] for rid in ids]


def abort_all(engine: LLMEngine) -> None:
    for rid in list(getattr(engine, "requests", {})):
        engine.abort_request(rid)


def one_rank_tokens(registry: Registry | None = None) -> list[list[int]]:
    """The reference: the same greedy requests on an engine of one rank (no executor at work)."""
    engine = LLMEngine(config(), registry=registry or get_registry(), progress=False)
    try:
        return generate(engine)
    finally:
        engine.shutdown()


# -- processes --------------------------------------------------------------------------------
def state(pid: int) -> str | None:
    """The process's state letter (``R``, ``S``, ``Z`` for a zombie...), None once it is gone;
    ``?`` where there is no /proc to tell (it exists, perhaps as a zombie)."""
    if not os.path.isdir("/proc"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def describe(pid: int) -> str:
    s = state(pid)
    if s is None:
        return f"pid {pid}: gone"
    if s == "Z":
        return f"pid {pid}: a zombie (it ended, but its parent never reaped it)"
    return f"pid {pid}: still running (state {s})"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still there (running or a zombie) after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if state(p) is not None]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def within(seconds: float, fn: Callable[[], Any], what: str) -> tuple[Any, float]:
    """``fn()`` in a daemon thread, waited for ``seconds``: (its result, seconds taken); its
    exception is raised here; still running by then, the test fails (the thread is left)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            box["error"] = e

    start = time.monotonic()
    thread = threading.Thread(target=run, name=f"modserve-conformance: {what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"{what} was still running after {seconds:g} s: it must not hang")
    if "error" in box:
        raise box["error"]
    return box.get("value"), time.monotonic() - start


# -- an engine of two ranks -----------------------------------------------------------------------
@dataclass
class Ranks:
    """One attempt at an engine of ``TP`` ranks through the executor under test."""

    implementation: Implementation
    folder: Path  # the probe's files: one per rank's process
    engine: LLMEngine | None = None
    error: BaseException | None = None  # why the engine did not start
    seconds: float = 0.0  # its start
    seen: set[int] = field(default_factory=set)  # worker pids ever found

    def workers(self, timeout: float = PIDS_WITHIN) -> list[int]:
        """The process ids of the ranks beyond the engine's own, on this machine; fails when a
        rank made no process of its own, skips when one runs on another machine."""
        me, deadline = os.getpid(), time.monotonic() + timeout
        while True:
            found = {int(p.name): p.read_text() for p in self.folder.iterdir() if p.name.isdigit()}
            others = {pid: host for pid, host in found.items() if pid != me}
            if len(others) >= TP - 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if len(others) < TP - 1:
            pytest.fail(f"{self.implementation}: {len(others)} of the {TP - 1} worker rank(s) built the engine's "
                        f"sampler in a process of its own (processes that did: {sorted(found)}, this one {me}): "
                        f"start() must run modserve.api.run_worker(spec) with each spec as given (its env and "
                        f"plugins), each in a process of its own")
        self.seen.update(others)
        away = {pid: host for pid, host in others.items() if host != socket.gethostname()}
        if away:
            pytest.skip(f"{self.implementation}: worker(s) {away} run on another machine; the kit checks the "
                        f"processes of this one only")
        return sorted(others)

    def require(self) -> LLMEngine:
        """The engine; skips for an executor that refuses ``TP`` ranks (a ValueError at start, as
        one that runs a single rank must) or lacks an optional dependency; fails otherwise."""
        if self.engine is not None:
            return self.engine
        e = self.error
        if isinstance(e, ValueError):
            pytest.skip(f"{self.implementation} refuses {TP} ranks: {e}")
        if isinstance(e, ImportError) or isinstance(getattr(e, "__cause__", None), ImportError):
            pytest.skip(f"{self.implementation} cannot be made here: {e}")
        pytest.fail(f"an engine of {TP} tensor-parallel ranks through {self.implementation} did not start: "
                    f"{type(e).__name__}: {e}")

    def shutdown(self) -> float:
        """``engine.shutdown()`` within SHUTDOWN_WITHIN: the seconds it took."""
        assert self.engine is not None
        return within(SHUTDOWN_WITHIN, self.engine.shutdown, f"engine.shutdown() with {self.implementation}")[1]

    def close(self) -> None:
        """After a test: the engine shut down (unless it hangs) and every worker it had on this
        machine SIGKILLed if still running. (A zombie is its parent's to reap.)"""
        try:
            if self.engine is not None:
                abort_all(self.engine)
                if not getattr(self.engine, "stopped", False):
                    try:
                        self.shutdown()
                    except BaseException:  # noqa: BLE001 - the test reports what went wrong
                        pass
        finally:
            for pid in self.seen:
                if state(pid) not in (None, "Z"):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            shutil.rmtree(self.folder, ignore_errors=True)


@contextmanager
def _environment(values: dict[str, str | None]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _probe_registered(registry: Registry) -> Iterator[None]:
    if probe.NAME in registry.names("sampler"):
        yield
    else:
        with registry.plugin(probe, probe.__name__):
            yield


@contextmanager
def shared_cluster(implementation: Implementation) -> Iterator[None]:
    """The built-in ray executor on its defaults: one local Ray cluster this process joins for
    the module's engines, each executor then joining it as "the Ray this process is already
    connected to" (its default). Each engine would otherwise start and stop a cluster of its
    own, the costliest part of its start; tests/test_executor_ray.py checks that path. A
    shared cluster also outlives ``shutdown()``, so a worker left there is seen. Anything
    else, options given or Ray already joined: nothing."""
    builtin_ray = (implementation is not None and implementation.options is None
                   and (implementation.kind, implementation.name) == ("executor", "ray")
                   and implementation.registration.distribution == "modserve")
    try:
        import ray
    except ImportError:
        builtin_ray = False
    if not builtin_ray or os.environ.get("RAY_ADDRESS") or ray.is_initialized():
        yield
        return
    from modserve.plugins.executors.ray_cluster import LocalCluster

    cluster = LocalCluster(2 * TP)  # the module's engine and a test's own, placed side by side
    try:
        ray.init(address=cluster.address)
        yield
    finally:
        ray.shutdown()
        cluster.stop()


def start(implementation: Implementation, linger: bool = False) -> Ranks:
    """An engine of ``TP`` ranks through ``implementation`` (its options from the command line),
    or the error its start raised. ``linger``: every worker's process stays once told to stop."""
    implementation.validated_options()  # skips, saying how to pass them, when they do not validate
    registry = implementation.registry or get_registry()
    ranks = Ranks(implementation, Path(tempfile.mkdtemp(prefix="modserve-conformance-pids-")))
    cfg = config(tensor_parallel_size=TP, sampler={"name": probe.NAME},
                 distributed_executor_backend={"name": implementation.name,
                                               "options": implementation.option_values()})
    env = {probe.PIDS: str(ranks.folder), probe.DRIVER: str(os.getpid()), probe.LINGER: "1" if linger else None}
    started = time.monotonic()
    with _probe_registered(registry), _environment(env):
        try:
            ranks.engine = LLMEngine(cfg, registry=registry, progress=False)
        except Exception as e:  # noqa: BLE001 - the tests say what it means
            ranks.error = e
    ranks.seconds = time.monotonic() - started
    return ranks
