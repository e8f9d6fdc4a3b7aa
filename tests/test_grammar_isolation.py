"""Grammar compiles run in worker processes that can always be stopped: a compile past
grammar_compile_timeout or grammar_compile_memory_mb is killed and its worker replaced,
two slow compiles do not hold quick ones for longer than the timeout, and SIGTERM ends
a server whatever a compile is doing. (Before, compiles ran on threads: none of this held.)"""

from __future__ import annotations

import os
import signal
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from modserve.api import GrammarBackend, GrammarMatcher, hookimpl
from modserve.core.config import PluginChoice
from modserve.engine.grammar import GrammarCompiler
from modserve.core.registry import PluginError, Registry
from modserve.core.structured_outputs import GrammarSpec, StructuredOutputs
from processes import alive, descendants, wait_until
from server_process import launch, stop, wait_healthy
from slow_grammars import deep_schema

EOS = 2
QUICK = GrammarSpec("regex", "quick")


class Stubborn(GrammarBackend):
    """Regex specs: "sleep" never returns, "hog" allocates until it cannot, others compile at once."""

    kinds = frozenset({"regex"})

    def compile(self, spec: GrammarSpec) -> str:
        if spec.value.startswith("sleep"):
            time.sleep(3600)  # like a C++ compile: nothing in this process can interrupt it
        if spec.value == "hog":
            held = []
            while True:
                held.append(bytearray(b"x") * 2**24)
        if spec.value in ("refuse", "break"):
            raise (ValueError if spec.value == "refuse" else RuntimeError)(f"{spec.value} it")
        return spec.value

    def matcher(self, compiled: str, max_rollback: int) -> GrammarMatcher:
        raise NotImplementedError


def _register(register) -> None:
    register("stubborn", f"{__name__}:Stubborn")  # by import path: a worker process imports it too


def _workers() -> dict[int, str]:
    return {pid: cmd for pid, cmd in descendants(os.getpid()).items() if "grammar_worker" in cmd}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture
def compiler(llama_dir):
    """GrammarCompiler(backend, **kw) on the test tokenizer; closed after the test, leaving no worker."""
    made = []

    def make(name: str, **kw) -> GrammarCompiler:
        registry = Registry()
        registry.load_entrypoints({"modserve"})
        registry.add_plugin(types.SimpleNamespace(register_grammar_backends=hookimpl(_register)), "stubborn")
        made.append(GrammarCompiler(registry, PluginChoice(name=name), llama_dir, 4100, [EOS], **kw))
        return made[-1]

    yield make
    for gc in made:
        gc.close()
    assert wait_until(lambda: not _workers(), timeout=5), f"compile workers left: {_workers()}"


def test_a_compile_past_the_timeout_is_killed_and_its_worker_replaced(compiler):
    gc = compiler("stubborn", num_workers=1, timeout=1.0)
    gc.compile(QUICK, timeout=60)  # the worker is up: what follows measures the compile only
    first = gc.worker_pids()
    started = time.monotonic()
    endless = gc.submit(GrammarSpec("regex", "sleep"))
    with pytest.raises(ValueError, match=r"grammar_compile_timeout=1 s; the compile was stopped"):
        endless.result(30)
    assert time.monotonic() - started < 1.0 + 1.0
    assert gc.submit(GrammarSpec("regex", "sleep")) is not endless, "a killed compile must not stay cached"
    assert gc.compile(GrammarSpec("regex", "next"), timeout=60).compiled == "next"
    assert len(first) == 1 and not alive(first[0]), "the timed-out compile's worker still runs"
    assert gc.worker_pids() and first[0] not in gc.worker_pids()
    # a worker's refusal and a backend's fault come back as they would from a thread
    with pytest.raises(ValueError, match="^regex constraint refused: stubborn: refuse it$"):
        gc.compile(GrammarSpec("regex", "refuse"), timeout=60)
    with pytest.raises(PluginError, match=r"^grammar_backend 'stubborn' from .*: compile\(\) raised RuntimeError"):
        gc.compile(GrammarSpec("regex", "break"), timeout=60)
    gc.close()
    assert not _workers() and not [t for t in threading.enumerate() if t.name.startswith("modserve-grammar")]


def test_a_compile_past_the_memory_cap_is_refused_naming_it(compiler):
    gc = compiler("stubborn", num_workers=1, memory_mb=256)
    gc.compile(QUICK, timeout=60)
    before = _rss_mb()
    with pytest.raises(ValueError, match=r"ran out of memory \(grammar_compile_memory_mb=256"):
        gc.compile(GrammarSpec("regex", "hog"), timeout=60)
    assert _rss_mb() - before < 50, "the compile's memory must be the worker's, not this process's"
    assert gc.compile(GrammarSpec("regex", "next"), timeout=60).compiled == "next"


def test_xgrammar_past_the_memory_cap_is_refused_too(compiler):
    """xgrammar's C++ allocations fail as std::bad_alloc at the cap (a RuntimeError, not MemoryError)."""
    gc = compiler("xgrammar", num_workers=1, memory_mb=128)
    with pytest.raises(ValueError, match=r"ran out of memory \(grammar_compile_memory_mb=128"):
        gc.compile(StructuredOutputs(json=deep_schema(8)).spec(), timeout=60)  # its grammar: ~300 MB


def test_two_slow_compiles_hold_a_quick_one_at_most_until_they_are_killed(compiler):
    timeout = 1.5
    gc = compiler("stubborn", num_workers=2, timeout=timeout)
    gc.compile(QUICK, timeout=60)
    wait_until(lambda: len(gc.worker_pids()) == 2, timeout=10)
    slow = [gc.submit(GrammarSpec("regex", f"sleep {i}")) for i in range(2)]
    time.sleep(0.2)  # both workers are busy with them
    started = time.monotonic()
    assert gc.compile(GrammarSpec("regex", "next"), timeout=60).compiled == "next"
    # Both workers were killed at the timeout, and replacements forked at once: it waited for that,
    # never for the slow compiles to end.
    assert time.monotonic() - started < timeout + 1.5
    for future in slow:
        assert "grammar_compile_timeout" in str(future.exception(1))


def test_thread_isolation_still_compiles(compiler):
    gc = compiler("auto", isolation="thread")
    schema = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}}).spec()
    assert gc.compile(schema, timeout=60).backend_name == "xgrammar" and not _workers()



def _workers_of(pid: int) -> list[int]:
    return [p for p, cmd in descendants(pid).items() if "grammar_worker" in cmd]


def test_sigterm_ends_the_server_during_a_long_compile(llama_dir, tmp_path):
    shutdown_timeout = 1.0
    s = launch(tmp_path, "grammar", "--model", llama_dir, "--num-threads", "1", "--max-model-len", "256",
               "--num-kv-blocks", "64", "--grammar-compile-timeout", "300", "--shutdown-timeout", str(shutdown_timeout),
               "--max-request-body-bytes", "4000000")
    try:
        wait_healthy(s)
        body = {"prompt": "x", "max_tokens": 4, "guided_json": deep_schema(13)}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{s.url}/v1/completions", json=body, timeout=300)
            # the template process and the two workers forked from it
            wait_until(lambda: len(_workers_of(s.proc.pid)) == 3, timeout=20)
            workers = _workers_of(s.proc.pid)
            time.sleep(2.0)  # one compiles
            assert not pending.done(), pending.result().text
            sent = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            code = s.proc.wait(timeout=300)
            took = time.monotonic() - sent
            answer = pending.result()
        assert code == 0, s.log.read_text()
        assert took < shutdown_timeout + 5, f"exited {took:.1f} s after SIGTERM"
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "server_shutting_down", answer.text
        assert len(workers) == 3, s.log.read_text()
        assert not [pid for pid in workers if alive(pid)], "compile workers outlived the server"
        assert not descendants(s.proc.pid)
    finally:
        stop(s)
