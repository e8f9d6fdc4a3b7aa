"""Starting an engine-core process: ``launch_core`` binds its three ZMQ sockets in a private
directory and spawns ``python -m modserve.engine.core_process``; a CoreLaunch is that process
and its sockets until its engine is Ready (server/engine_process.py takes it from there).

NOTE: this module imports neither torch nor transformers, so ``modserve serve`` starts its
cores before its own heavy imports, and the two processes import at once.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import msgspec
import zmq

from modserve.core.config import EngineConfig
from modserve.engine import core_protocol as p
from modserve.engine.core_process import LaunchSpec

logger = logging.getLogger("modserve.server")

READ_POLL_MS = 200  # a start's waits (and the server's reader thread) look at the process at least this often
BUILD_LOG_EVERY_S = 30.0


class EngineStartError(RuntimeError):
    """An engine-core process failed before it was ready: its build's error, or how it ended."""


@dataclass
class CoreLaunch:
    """One started core process and the sockets to it, before its engine is built."""

    dp_rank: int
    proc: subprocess.Popen  # or, for a core on another machine, a RemoteProc (server/remote_cores.py)
    context: zmq.Context
    inbox: zmq.Socket
    outbox: zmq.Socket
    beats: zmq.Socket
    run_dir: str
    lock: threading.Lock = field(default_factory=threading.Lock)  # inbox sends (the loop, the drain's thread)

    def send(self, message: msgspec.Struct) -> None:
        with self.lock:
            if self.inbox.closed:  # a killed remote core, which reads nothing more
                return
            try:
                # NOTE: PUSH blocks, HWM or not, once its one peer is gone: never on the event loop.
                self.inbox.send(p.encode(message), zmq.NOBLOCK)
            except zmq.Again:  # the core's connection closed: the watchdog is about to declare it dead
                pass

    def ended(self) -> str | None:
        """How the core's process ended, or None while it runs."""
        code = self.proc.poll()
        return None if code is None else getattr(self.proc, "how_ended", "") or f"exited with code {code}"

    def _while_alive(self, done: Callable[[], bool], what: str) -> None:
        """Call ``done`` (which polls a socket) until it is true, while the process lives."""
        started = last_log = time.monotonic()
        while not done():
            if (ended := self.ended()) is not None:
                raise EngineStartError(f"engine core {self.dp_rank} (pid {self.proc.pid}) {ended} "
                                       f"while {what} (its log above says why)")
            if time.monotonic() - last_log > BUILD_LOG_EVERY_S:
                last_log = time.monotonic()
                logger.info("engine core %d: still %s (%.0f s)", self.dp_rank, what, last_log - started)

    def start(self) -> None:
        """Tell the core to build its engine, once its inbox connection is up here."""
        # NOTE: the core's Hello comes on the outbox, a connection of its own: the inbox's may not be
        # attached on this side yet, and a PUSH without a peer drops a NOBLOCK send (`send`).
        self._while_alive(lambda: bool(self.inbox.poll(READ_POLL_MS, zmq.POLLOUT)), "connecting")
        logger.info("engine core %d (pid %d): building the engine", self.dp_rank, self.proc.pid)
        self.send(p.Start())

    def wait_for(self, kinds: tuple[type, ...], what: str) -> Any:
        """The next message on the outbox (one of ``kinds``, or Failed raised), while the process lives."""
        self._while_alive(lambda: bool(self.outbox.poll(READ_POLL_MS)), what)
        message = p.decode_from_core(self.outbox.recv())
        if isinstance(message, p.Failed):
            raise EngineStartError(f"engine core {self.dp_rank} failed to build its engine: {message.error}")
        if not isinstance(message, kinds):
            raise EngineStartError(f"engine core {self.dp_rank} sent {type(message).__name__} while {what}")
        return message

    def kill(self) -> None:
        """SIGKILL the core's process group (its workers too), then reap it. A remote core's inbox
        is closed instead: the core ends itself once its connection drops."""
        if not isinstance(self.proc, subprocess.Popen):
            self.proc.kill()
            with self.lock:
                self.inbox.close(linger=0)
        elif self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def close(self) -> None:
        for sock in (self.inbox, self.outbox, self.beats):
            sock.close(linger=0)
        if not isinstance(self.proc, subprocess.Popen):
            self.proc.close()
        self.context.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def launch_cores(configs: list[EngineConfig], first_rank: int = 0) -> list[CoreLaunch]:
    """One engine-core process per config (ranks ``first_rank`` on), all started at once; if one
    fails to start, the ones before it are killed."""
    launches: list[CoreLaunch] = []
    try:
        for rank, config in enumerate(configs, first_rank):
            launches.append(launch_core(config, rank))
    except BaseException:
        end_launches(launches)
        raise
    return launches


def end_launches(launches: Iterable[CoreLaunch]) -> None:
    """Kill each core (its workers too) and close its sockets: a start that failed part-way."""
    for launch in launches:
        launch.kill()
        launch.close()


def launch_core(config: EngineConfig, dp_rank: int) -> CoreLaunch:
    """Start one engine-core process for ``config`` (this rank's), its sockets bound here."""
    run_dir = tempfile.mkdtemp(prefix=f"modserve-core{dp_rank}-")
    context = zmq.Context()
    inbox, outbox, beats = context.socket(zmq.PUSH), context.socket(zmq.PULL), context.socket(zmq.PULL)
    inbox.setsockopt(zmq.SNDHWM, 0)  # never block the event loop: commands queue until the core reads
    addresses = {}
    for name, sock in (("inbox", inbox), ("outbox", outbox), ("beats", beats)):
        addresses[name] = f"ipc://{run_dir}/{name}"
        sock.bind(addresses[name])
    spec = LaunchSpec(config.model_dump_json(), dp_rank, parent_pid=os.getpid(), **addresses)
    return CoreLaunch(dp_rank, spawn_core(spec), context, inbox, outbox, beats, run_dir)


def spawn_core(spec: LaunchSpec) -> subprocess.Popen:
    """``python -m modserve.engine.core_process`` with ``spec`` on its stdin."""
    # NOTE: OpenMP's wait policy is left at its default: OMP_WAIT_POLICY=PASSIVE made each op's
    # wake-up slower than the cores it left to the API server were worth (docs/server.md).
    env = dict(os.environ)
    env["MODSERVE_LOG_LEVEL"] = logging.getLevelName(logging.getLogger("modserve").getEffectiveLevel())
    # A session of its own: the terminal's Ctrl-C reaches the server alone, and killpg ends the core
    # with every worker it started.
    proc = subprocess.Popen([sys.executable, "-m", "modserve.engine.core_process"], stdin=subprocess.PIPE,
                            env=env, start_new_session=True)
    proc.stdin.write(msgspec.json.encode(spec))  # type: ignore[union-attr]
    proc.stdin.close()  # type: ignore[union-attr]
    return proc
