"""Grammar compiles in worker processes, so that one can always be stopped.

A grammar library cannot be interrupted inside a thread: a pathological spec would
compile (and grow) forever. Here a few worker processes compile one spec at a time and
send the result back as the backend's ``serialize`` bytes. A compile past its deadline
is killed (its worker too, and another takes its place), and a worker's address space is
capped at ``grammar_compile_memory_mb`` above what its imports took.

Workers are forked from a template process (:mod:`modserve.engine.grammar_worker`) that
imported the backends once, so a replacement is ready at once. The template is a fresh
interpreter importing only that module, started on the first compile: the engine's
process runs torch threads (a fork of it is unsafe), and multiprocessing's spawn would
run the user's unguarded script again.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from multiprocessing.reduction import recv_handle
from typing import Any, Callable

from modserve.core.config import PluginChoice
from modserve.engine.grammar_compile import START_TIMEOUT_S, CompilerClosed
from modserve.engine.grammar_worker import WorkerSetup
from modserve.core.registry import Registration
from modserve.core.structured_outputs import GrammarSpec

logger = logging.getLogger("modserve")


@dataclass(slots=True)
class _Job:
    spec: GrammarSpec
    names: list[str]
    future: Future
    submitted: float


@dataclass(slots=True, eq=False)
class _Worker:
    pid: int
    conn: Connection
    ready_at: float
    exit_code: int | None = None
    stopped: bool = False


class _Template:
    """The process workers are forked from; its pipe is shared by the feeding threads."""

    def __init__(self) -> None:
        self.conn, self._theirs = Pipe()
        command = [sys.executable, "-c", f"from modserve.engine.grammar_worker import template_main; "
                   f"template_main({self._theirs.fileno()})"]
        self.process = subprocess.Popen(command, pass_fds=[self._theirs.fileno()], stdin=subprocess.DEVNULL)
        self._lock = threading.Lock()
        self.ready = False

    def wait_ready(self, setup: WorkerSetup) -> None:
        self._theirs.close()
        try:
            self.conn.send(sys.path)
            self.conn.send(setup)
            if not self.conn.poll(START_TIMEOUT_S):
                raise RuntimeError(f"the grammar compile template process did not start within {START_TIMEOUT_S:g} s")
            self.conn.recv()
            self.ready = True
        except (EOFError, OSError):
            self.close()
            raise RuntimeError(f"the grammar compile template process failed to start "
                               f"({how_it_ended(self.process.returncode)})") from None
        except BaseException:
            self.close()
            raise

    def fork(self) -> tuple[int, Connection]:
        with self._lock:
            self.conn.send(("fork",))
            pid = self.conn.recv()
            return pid, Connection(recv_handle(self.conn))

    def reap(self, pid: int) -> int | None:
        """The exit code of worker ``pid``, which was killed."""
        with self._lock:
            self.conn.send(("reap", pid))
            return self.conn.recv()

    def close(self) -> None:
        self.conn.close()
        self.process.kill()
        self.process.wait()


class CompileWorkers:
    """``num_workers`` processes fed from one queue, each by a thread of this process.

    A compile's Future ends by ``timeout`` seconds after it was submitted or after its
    worker was ready, whichever is later (start-up is not the spec's fault): with the
    result, the spec's refusal, the timeout (the worker killed), or the memory cap.
    ``finish(name, data, seconds, spec)`` turns a worker's bytes into the Future's result.
    """

    def __init__(self, num_workers: int, timeout: float, setup: Callable[[], WorkerSetup],
                 finish: Callable[[str, bytes, float, GrammarSpec], Any],
                 timeout_error: Callable[[GrammarSpec], Exception],
                 memory_error: Callable[[GrammarSpec, str], Exception]) -> None:
        self.timeout = timeout
        self._setup, self._finish = setup, finish
        self._timeout_error, self._memory_error = timeout_error, memory_error
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._template: _Template | None = None
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()  # the workers, the template and closing
        self._template_lock = threading.Lock()  # one start at a time
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, name=f"modserve-grammar-{i}", daemon=True)
                         for i in range(num_workers)]
        for t in self._threads:
            t.start()

    def submit(self, spec: GrammarSpec, names: list[str]) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise CompilerClosed()
            self._jobs.put(_Job(spec, names, future, time.monotonic()))
        return future

    def close(self) -> None:
        """Kill every process, fail what is queued, and join the feeding threads (idempotent)."""
        with self._lock:
            self._closed = True
            for w in self._workers:
                _kill(w.pid)  # a feeding thread waiting on it wakes up with EOF, and reaps it
            if self._template is not None and not self._template.ready:
                self._template.process.kill()  # still importing: the thread waiting for it goes on
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join()
        with self._template_lock:
            if self._template is not None:
                self._template.close()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(CompilerClosed())

    def pids(self) -> list[int]:
        """The worker processes' (the template's not included)."""
        with self._lock:
            return [w.pid for w in self._workers]

    # -- one feeding thread -----------------------------------------------------------------
    def _serve(self) -> None:
        worker = self._try_start()  # now: the first compile is soon, and others may follow
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                if worker is None:
                    worker = self._start()
                if not self._run(job, worker):
                    self._stop(worker)
                    worker = self._try_start()
            except BaseException as e:  # noqa: BLE001 - every Future must end
                if not job.future.done():
                    job.future.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
                if worker is not None:
                    self._stop(worker)
                    worker = None
        if worker is not None:
            self._stop(worker)

    def _run(self, job: _Job, worker: _Worker) -> bool:
        """Compile ``job`` on ``worker``; False when the worker must be replaced."""
        remaining = max(job.submitted, worker.ready_at) + self.timeout - time.monotonic()
        if remaining <= 0:  # waited its whole time in the queue
            job.future.set_exception(self._timeout_error(job.spec))
            return True
        worker.conn.send((job.spec, job.names))
        if not worker.conn.poll(remaining):
            self._stop(worker)  # first: the Future's waiters see its worker gone
            job.future.set_exception(self._timeout_error(job.spec))
            return False
        try:
            reply = worker.conn.recv()
        except (EOFError, OSError):
            self._stop(worker)
            if self._closed:
                job.future.set_exception(CompilerClosed())
            else:  # the backend's allocator aborts at the address-space cap
                job.future.set_exception(self._memory_error(job.spec, how_it_ended(worker.exit_code)))
            return False
        if reply[0] == "ok":
            job.future.set_result(self._finish(*reply[1:], job.spec))
        elif reply[0] == "memory":
            job.future.set_exception(self._memory_error(job.spec, "an allocation failed"))
            return False
        else:
            job.future.set_exception(reply[1])
        return True

    def _try_start(self) -> _Worker | None:
        if self._closed:
            return None
        try:
            return self._start()
        except Exception as e:  # the next compile tries again, and fails with the reason
            logger.warning("%s", e)
            return None

    def _start(self) -> _Worker:
        with self._template_lock:
            if self._closed:
                raise CompilerClosed()
            if self._template is None or self._template.process.poll() is not None:
                started = time.monotonic()
                setup = self._setup()  # the vocabulary: the tokenizer's load
                with self._lock:
                    if self._closed:
                        raise CompilerClosed()
                    self._template = _Template()
                self._template.wait_ready(setup)
                logger.info("grammar compile template process %d ready in %.1f s", self._template.process.pid,
                            time.monotonic() - started)
            template = self._template
        pid, conn = template.fork()
        worker = _Worker(pid, conn, 0.0)
        with self._lock:
            self._workers.add(worker)
            closed = self._closed
        if closed or not conn.poll(START_TIMEOUT_S):
            self._stop(worker)
            raise CompilerClosed() if closed else RuntimeError("a grammar compile worker did not start")
        try:
            conn.recv()
        except (EOFError, OSError):
            self._stop(worker)
            raise RuntimeError(f"a grammar compile worker failed to start ({how_it_ended(worker.exit_code)})")
        worker.ready_at = time.monotonic()
        return worker

    def _stop(self, worker: _Worker) -> None:
        if worker.stopped:
            return
        worker.stopped = True
        _kill(worker.pid)
        try:
            worker.exit_code = self._template.reap(worker.pid) if self._template is not None else None
        except (EOFError, OSError):  # the template is gone: its workers went with it
            pass
        worker.conn.close()
        with self._lock:
            self._workers.discard(worker)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)  # NOTE: not yet reaped (only the reap does that): never another's pid
    except ProcessLookupError:
        pass


def how_it_ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"the worker was ended by {signal.Signals(-exitcode).name}"
    return f"the worker exited with status {exitcode}"


def picklable(reg: Registration, choice: PluginChoice) -> tuple[Registration, PluginChoice] | str:
    """What a worker needs to make this backend, or why it cannot."""
    try:
        pickle.dumps((reg, choice))
    except Exception as e:
        return (f"its registration ({reg.origin}) cannot reach a compile worker process ({e}): register it "
                "by import path ('module:Class'), or set grammar_compile_isolation=thread")
    return reg, choice
