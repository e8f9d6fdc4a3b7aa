"""mp: one process per tensor-parallel rank on this machine, started with ``spawn``.

Spawned, not forked: a fork would copy the engine's threads, locks and loaded plugins
half-way through. No worker outlives the engine's process:

- stopped: ``shutdown()`` waits ``stop_timeout`` for the workers rank 0 told to stop (one
  second when one is already gone: the group is broken, the rest will not get the word),
  then SIGKILLs and reaps what is left;
- the engine's interpreter exits without a shutdown: each worker is a daemon, which
  multiprocessing ends at exit;
- the engine's process is killed: a worker that has joined the group fails its next
  collective when rank 0's sockets close; one still starting (importing, loading, waiting
  to join) has a watchdog that ends it once its parent is no longer the engine's process.

Workers ignore SIGINT: a Ctrl-C in a terminal reaches the whole process group, and the
engine, which drains and then stops them, decides when they end.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time

from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from modserve.api import Executor, WorkerSpec, run_worker

logger = logging.getLogger("modserve")

WATCHDOG_INTERVAL = 0.5  # seconds between a worker's looks at its parent
BROKEN_GROUP_GRACE = 1.0  # seconds shutdown() waits once a worker is gone


class MultiprocessOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stop_timeout: float = Field(10.0, gt=0, description="Seconds a worker may take to stop before it is killed")


class MultiprocessExecutor(Executor):
    def __init__(self, options: MultiprocessOptions | None = None) -> None:
        super().__init__(options or MultiprocessOptions())
        self.procs: list[mp.process.BaseProcess] = []
        self.ranks: list[int] = []
        self._failure: str | None = None

    def start(self, workers: list[WorkerSpec]) -> None:
        ctx = mp.get_context("spawn")
        try:
            for spec in workers:
                proc = ctx.Process(target=worker_main, args=(spec, os.getpid()), name=f"modserve-rank-{spec.rank}",
                                   daemon=True)
                proc.start()
                self.procs.append(proc)
                self.ranks.append(spec.rank)
        except BaseException:
            self._kill()  # those started would wait to join for minutes
            raise

    def failed(self) -> str | None:
        """Why a worker is gone, or None: a non-blocking ``waitpid`` per worker (polled by the engine)."""
        if self._failure is None:
            for rank, proc in zip(self.ranks, self.procs):
                code = proc.exitcode  # waitpid(WNOHANG): never blocks
                if code is not None:
                    self._failure = f"rank {rank} (pid {proc.pid}) ended with {describe_exit(code)}"
                    break
        return self._failure

    def shutdown(self) -> None:
        # A failure seen before (by stop_ranks, or the start) means no worker got the word to stop.
        grace = min(self.options.stop_timeout, BROKEN_GROUP_GRACE) if self._failure else self.options.stop_timeout
        deadline = time.monotonic() + grace
        for proc in self.procs:  # one deadline for all: N workers stop in stop_timeout, not N times it
            proc.join(max(0.0, deadline - time.monotonic()))
        ended = [f"rank {rank} (pid {proc.pid}) " + (f"killed, still running after {grace:g} s" if proc.exitcode is None
                                                     else f"ended with {describe_exit(proc.exitcode)}")
                 for rank, proc in zip(self.ranks, self.procs)]
        self._kill()
        if ended:
            logger.info("mp executor: workers stopped: %s", "; ".join(ended))

    def _kill(self) -> None:
        """SIGKILL every worker still running, and reap them all."""
        for proc in self.procs:
            if proc.exitcode is None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            proc.join()  # SIGKILLed: promptly
            proc.close()
        self.procs, self.ranks = [], []


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def worker_main(spec: WorkerSpec, driver_pid: int) -> None:
    """A spawned worker's life: :func:`run_worker`, watched, ignoring the terminal's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # NOTE: tqdm's default lock holds a multiprocessing lock, in a spawned process a named
    # semaphore in /dev/shm that only the resource tracker removes (this process ends in
    # os._exit); a killed process group (a hung core's) takes the tracker with it, and the
    # semaphore stays. A worker draws no bar beside another process.
    tqdm.set_lock(threading.RLock())
    threading.Thread(target=_watch_parent, args=(driver_pid,), name="modserve-watchdog", daemon=True).start()
    run_worker(spec)
    # Told to stop and out of the group: wait for the threads the interpreter would wait for
    # (a plugin's), then exit without finalizing it: there a C++ thread torch.distributed
    # leaves behind (gloo's) can abort the process ("terminate called without an active
    # exception", SIGABRT) after a clean stop.
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _watch_parent(driver_pid: int) -> None:
    """End this process once its parent is no longer the engine's process (killed: this one
    was re-parented), wherever the worker is: importing, loading, or waiting in a collective."""
    while os.getppid() == driver_pid:
        time.sleep(WATCHDOG_INTERVAL)
    print(f"modserve worker {os.getpid()}: the engine's process {driver_pid} is gone; exiting",
          file=sys.stderr, flush=True)
    os._exit(1)
