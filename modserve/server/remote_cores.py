"""Engine cores on other machines (started there by ``modserve serve --headless``), seen from the
API server: sockets bound on tcp:// for each remote data-parallel rank, and the handshake that
hands them out (modserve/engine/core_handshake.py).

After the handshake a remote core is a CoreLaunch like a local one, with a RemoteProc where a
local one has its Popen: the same Hello/Start/Ready, the same EngineProcess, watchdog,
heartbeats and step_timeout. What differs is how its end is seen and caused:
- it "exits" when its connection to the outbox drops (ZMQ socket monitor): its process, or its
  machine, is gone;
- killing it closes the inbox's connection: the core then ends itself and its workers
  (modserve/engine/remote_core.py). A core that is stopped (SIGSTOP) ends once it resumes.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from modserve.core.config import EngineConfig
from modserve.engine import core_handshake as h
from modserve.engine.core_protocol import PROTOCOL_VERSION
from modserve.server.core_launch import CoreLaunch, EngineStartError, end_launches

logger = logging.getLogger("modserve.server")

WAIT_LOG_EVERY_S = 10.0
CONNECT_TIMEOUT_S = 30.0  # a core that joined connects its sockets at once: past this, it is gone


def ready_timeout() -> float:
    """Seconds the API server waits for every rank to join (vLLM's VLLM_ENGINE_READY_TIMEOUT_S)."""
    return float(os.environ.get("VLLM_ENGINE_READY_TIMEOUT_S", "600"))


class RemoteProc:
    """The Popen of a core on another machine, as far as the server can know it: ``pid`` is the
    one its Hello gave, and it has "exited" once the connection to it dropped."""

    def __init__(self, monitor: zmq.Socket) -> None:
        self.pid = 0
        self.host = "?"
        self.returncode: int | None = None
        self.how_ended = ""
        self.joined_at: float | None = None  # when its handshake was answered
        self._monitor = monitor
        self._connected = False
        self._lock = threading.Lock()  # the reader thread's watchdog and the loop's stop() both poll

    def poll(self) -> int | None:
        with self._lock:
            while self.returncode is None and self._monitor.poll(0):
                event = recv_monitor_message(self._monitor)["event"]
                self._connected = self._connected or event == zmq.EVENT_ACCEPTED
                if event == zmq.EVENT_DISCONNECTED and self._connected:
                    self.returncode = -1
                    self.how_ended = f"on {self.host}: its connection closed (the process or its machine is gone)"
            if (self.returncode is None and not self._connected and self.joined_at is not None
                    and time.monotonic() - self.joined_at > CONNECT_TIMEOUT_S):
                self.returncode = -1
                self.how_ended = f"on {self.host}: joined but never connected in {CONNECT_TIMEOUT_S:g} s"
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"engine core on {self.host}", timeout or 0.0)
            time.sleep(0.05)
        return code

    def kill(self) -> None:
        with self._lock:
            if self.returncode is None:
                self.returncode = -9
                self.how_ended = f"on {self.host}: disconnected by this server"

    def close(self) -> None:
        with self._lock:
            self._monitor.close(linger=0)


@dataclass(frozen=True)
class RemoteRanks:
    """engine_process.RemoteRanks: the ranks past ``num_local`` join at tcp://address:port
    (vLLM's --data-parallel-address, --data-parallel-rpc-port)."""

    num_local: int
    address: str
    port: int
    config: EngineConfig  # the base config: a joining rank's must match it (core_handshake.fingerprint)

    def join(self, ranks: range) -> list[CoreLaunch]:
        launches: list[CoreLaunch] = []
        try:
            for rank in ranks:
                launches.append(bind_remote_core(rank, self.address))
            await_remote_cores(launches, self.address, self.port, self.config, ready_timeout())
        except BaseException:
            end_launches(launches)
            raise
        return launches


def bind_remote_core(dp_rank: int, address: str) -> CoreLaunch:
    """Rank ``dp_rank``'s inbox, outbox and beats, bound on ``address``'s free tcp ports."""
    context = zmq.Context()
    inbox, outbox, beats = context.socket(zmq.PUSH), context.socket(zmq.PULL), context.socket(zmq.PULL)
    inbox.setsockopt(zmq.SNDHWM, 0)  # never block the event loop: commands queue until the core reads
    for sock in (inbox, outbox, beats):
        sock.bind_to_random_port(f"tcp://{address}")
    monitor = outbox.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
    return CoreLaunch(dp_rank, RemoteProc(monitor), context, inbox, outbox, beats, run_dir="")  # type: ignore[arg-type]


def await_remote_cores(launches: list[CoreLaunch], address: str, port: int, config: EngineConfig,
                       timeout: float, failed: Callable[[], str | None] | None = None) -> None:
    """Answer the handshakes on ``tcp://address:port`` until every rank of ``launches`` joined,
    refusing a rank whose config differs from ``config``; EngineStartError after ``timeout``, or
    once ``failed`` names why a rank will not come (cores this server had started: Ray's)."""
    waiting = {launch.dp_rank: launch for launch in launches}
    mine = h.fingerprint(config)
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 1000)  # the last answer still goes out
    router.bind(f"tcp://{address}:{port}")
    logger.info("data parallel: waiting for rank(s) %s to join at tcp://%s:%d (%s)", sorted(waiting), address, port,
                "modserve serve --headless on their machines" if failed is None else "their Ray actors")
    started = last_log = time.monotonic()
    try:
        while waiting:
            if router.poll(200):
                identity, data = router.recv_multipart()
                router.send_multipart([identity, h.encode(_answer(h.decode_handshake(data), waiting, mine))])
                continue
            now = time.monotonic()
            if failed is not None and (why := failed()) is not None:
                raise EngineStartError(f"data-parallel rank(s) {sorted(waiting)} will not join: {why}")
            if now - started > timeout:
                raise EngineStartError(f"data-parallel rank(s) {sorted(waiting)} did not join at tcp://{address}:"
                                       f"{port} within {timeout:g} s (VLLM_ENGINE_READY_TIMEOUT_S)")
            if now - last_log > WAIT_LOG_EVERY_S:
                last_log = now
                logger.info("data parallel: still waiting for rank(s) %s (%.0f s)", sorted(waiting), now - started)
    finally:
        router.close()
        context.term()


def _answer(hello: h.Handshake, waiting: dict[int, CoreLaunch], mine: dict[str, str]) -> h.Answer:
    """Welcome (and the rank leaves ``waiting``), or Refused naming why."""
    rank = hello.dp_rank
    if hello.version != PROTOCOL_VERSION:
        reason = f"protocol version {hello.version}, this API server speaks {PROTOCOL_VERSION} (run one modserve)"
    elif rank not in waiting:
        reason = f"rank {rank} is not one this API server waits for (still waiting: {sorted(waiting)})"
    elif diff := h.differences(mine, hello.fingerprint):
        reason = "its config differs from the API server's in: " + "; ".join(diff)
    else:
        launch = waiting.pop(rank)
        launch.proc.host, launch.proc.joined_at = hello.host, time.monotonic()  # type: ignore[union-attr]
        logger.info("data parallel: rank %d joined from %s", rank, hello.host)
        return h.Welcome(*(sock.getsockopt_string(zmq.LAST_ENDPOINT)
                           for sock in (launch.inbox, launch.outbox, launch.beats)))
    logger.warning("data parallel: refused rank %d from %s: %s", rank, hello.host, reason)
    return h.Refused(reason)
