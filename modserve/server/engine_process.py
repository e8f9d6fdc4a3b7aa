"""EngineProcess: the server's client of one engine-core process (modserve/engine/core_process.py).

``start_engine_processes(configs)`` starts one core per data-parallel rank, all at once (their
imports overlap; or takes the ones a caller started before its own imports), loads the front
end's tokenizers meanwhile, then lets the cores build one after the other (each sizes its KV
cache on the memory the ones before left). Each core gets three ZMQ sockets, bound here in a
private directory (server/core_launch.py): ``inbox`` (commands, PUSH), ``outbox`` (outputs,
PULL), ``beats`` (heartbeats, PULL).

NOTE: a reader thread owns the outbox and beats sockets: it decodes each step's outputs off the
event loop, turns their token ids into text (the output processor: detokenization, stop
strings, logprob entries; a stop string found ends its sequence in the core with
StopSequence), hands them to it with one ``call_soon_threadsafe``, and is the watchdog. The core
is declared dead, and its process group killed (its tensor-parallel workers with it), when
its process exits, when no heartbeat came for ``step_timeout`` (a stopped or wedged process),
or when one step has run for ``step_timeout`` (a hung rank or collective).
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
import time
from collections import deque
from concurrent.futures import Future
from itertools import count
from typing import Any, Callable, Protocol

import msgspec
import zmq

from modserve.core.config import EngineConfig
from modserve.core.registry import PluginError
from modserve.core.structured_outputs import GrammarSpec
from modserve.engine import core_protocol as p
from modserve.engine.grammar_compile import CompilerClosed
from modserve.engine.output_processor import OutputProcessor
from modserve.engine.tokenizer import Tokenizer
from modserve.server.core_launch import READ_POLL_MS, CoreLaunch, EngineStartError, end_launches, launch_cores
from modserve.server.engine_frontend import (AbortRequest, AddRequest, EngineDead, EngineError, EngineFrontend, EngineStopped,
                                             PluginFailed, RequestObserver, Result)

logger = logging.getLogger("modserve.server")

STATS_WAIT_S = 0.5  # /metrics waits this long for fresh figures from a core, then takes its last heartbeat's


class RemoteRanks(Protocol):
    """The ranks past the first ``num_local`` run on other machines (``--headless``); ``join``
    binds their sockets and waits until each joined (server/remote_cores.py)."""

    num_local: int

    def join(self, ranks: range) -> list[CoreLaunch]: ...


def start_engine_processes(configs: list[EngineConfig], observer: RequestObserver | None = None,
                           first_rank: int = 0, remote: RemoteRanks | None = None,
                           launched: list[CoreLaunch] | None = None) -> list[EngineProcess]:
    """One engine-core process per config (data-parallel ranks ``first_rank`` on), each Ready; if
    one fails, every one started is killed and EngineStartError says why. With ``remote``, the
    ranks past its ``num_local`` are started on their machines and join here first. ``launched``:
    this machine's cores, already started by the caller (``launch_cores``), now owned here."""
    num_local = len(configs) if remote is None else remote.num_local
    launches = launch_cores(configs[:num_local], first_rank) if launched is None else list(launched)
    engines: list[EngineProcess] = []
    try:
        # The output processors' tokenizers load here while the cores import and build: this
        # thread only waits for them until Ready.
        outputs = [OutputProcessor(Tokenizer(c.tokenizer or c.model, c.model)) for c in configs]
        if remote is not None:
            launches += remote.join(range(first_rank + num_local, first_rank + len(configs)))
        for launch in launches:
            hello = launch.wait_for((p.Hello,), "starting")
            if not isinstance(launch.proc, subprocess.Popen):
                launch.proc.pid = hello.pid  # its own machine's
        # This machine's cores build one after the other; other machines' (their own memory) at once.
        for launch in launches[:min(1, num_local)] + launches[num_local:]:
            launch.start()
        for i, (config, launch) in enumerate(zip(configs, launches)):
            if 0 < i < num_local:
                launch.start()
            ready = launch.wait_for((p.Ready,), "building its engine")
            prefix = f"r{launch.dp_rank}-" if len(configs) > 1 else ""
            engines.append(EngineProcess(config, launch, ready, outputs[i], observer, prefix))
    except BaseException:
        end_launches(launches)
        raise
    return engines



class EngineProcess(EngineFrontend):
    """The client of one Ready engine-core process (see the module's docstring)."""

    def __init__(self, config: EngineConfig, launch: CoreLaunch, ready: p.Ready, outputs: OutputProcessor,
                 observer: RequestObserver | None = None, id_prefix: str = "") -> None:
        super().__init__(config, p.unpack(ready.limits), ready.num_kv_blocks, observer, id_prefix)
        self.launch = launch
        self.pid = launch.proc.pid
        self.step_timeout = config.step_timeout
        # The requests' user side, added on the loop and read on the reader thread (vLLM's front end's).
        self._outputs = outputs
        self._aborted: deque[str] = deque()  # (loop -> reader) requests for the output processor to forget
        self._compiles: dict[int, Future] = {}  # grammar compiles awaiting their answer
        self._calls: dict[int, Future] = {}  # utility calls awaiting theirs
        self._keys = count()
        self._reader: threading.Thread | None = None
        self._closing = threading.Event()
        self._dying: str | None = None  # set by the reader thread once it declared the core dead
        self.last_beat = time.monotonic()
        self.stats_time = time.monotonic()

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.last_beat = time.monotonic()
        self._reader = threading.Thread(target=self._read, name=f"modserve-core{self.launch.dp_rank}-reader",
                                        daemon=True)
        self._reader.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Tell the core to stop (it frees what its requests held and stops its workers) and wait."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self.launch.proc.poll() is None:
            try:
                self.launch.send(p.Shutdown())
                self.launch.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("engine core %d did not stop within %.0f s: killing it", self.launch.dp_rank, timeout)
        self.launch.kill()
        if self._reader is not None:
            self._reader.join()

    def shutdown_engine(self) -> None:
        self.stop(0.0 if self._dying else 10.0)
        self._fail_compiles("the engine stopped")
        self.launch.close()

    @property
    def alive(self) -> bool:
        return (self._dead_reason is None and self._dying is None and self._reader is not None
                and not self._closing.is_set())

    # -- loop side --------------------------------------------------------------------------------
    def _send(self, command: AddRequest | AbortRequest) -> None:
        if isinstance(command, AddRequest):
            self._outputs.add(command.request_id, command.prompt_token_ids, command.params, command.arrival_time)
            message: msgspec.Struct = p.Add(command.request_id, command.prompt_token_ids, p.pack(command.params),
                                            command.arrival_time, command.priority,
                                            p.pack(command.lora_request) if command.lora_request else b"")
        else:
            message = p.Abort([command.request_id])
            self._aborted.append(command.request_id)
        self.launch.send(message)

    async def stats(self) -> dict[str, Any]:
        """engine.stats() read between the core's steps, or, when that takes longer than
        STATS_WAIT_S (a long step, a hung core), what its last heartbeat said; with their age."""
        if self.alive:
            try:
                self.last_stats = await asyncio.wait_for(self.call_utility("stats"), STATS_WAIT_S)
                self.stats_time = time.monotonic()
            except (TimeoutError, EngineError, EngineDead):
                pass  # the heartbeat's figures
        return {**self.last_stats, "stats_age_s": self.stats_age_s}

    @property
    def stats_age_s(self) -> float:
        return time.monotonic() - self.stats_time

    def compile_grammar(self, spec: GrammarSpec) -> Future:
        """Compiled on the core's grammar workers (the engine then finds it in their cache)."""
        future: Future = Future()
        if not self.alive:
            future.set_exception(CompilerClosed("the engine is not running"))
            return future
        key = next(self._keys)
        self._compiles[key] = future
        self.launch.send(p.CompileGrammar(key, p.pack(spec)))
        return future

    async def call_utility(self, method: str, *args: Any) -> Any:
        if not self.alive:
            raise EngineDead("the engine is not running")
        future: Future = Future()
        key = next(self._keys)
        self._calls[key] = future
        self.launch.send(p.Utility(key, method, p.pack(args)))
        return await asyncio.wrap_future(future)

    def stop_compiles(self) -> None:
        if self.launch.proc.poll() is None:
            self.launch.send(p.StopCompiles())

    # -- the reader thread ------------------------------------------------------------------------
    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self.launch.outbox, zmq.POLLIN)
        poller.register(self.launch.beats, zmq.POLLIN)
        step_running = 0.0
        while not self._closing.is_set() and self._dying is None:
            ready = dict(poller.poll(READ_POLL_MS))
            if self.launch.beats in ready:
                while self.launch.beats.poll(0):
                    beat = p.decode_from_core(self.launch.beats.recv())
                    self.last_beat, step_running = time.monotonic(), beat.step_running_s
                    self.last_stats = p.unpack(beat.stats)
                    self.stats_time = time.monotonic() - beat.stats_age_s
            if self.launch.outbox in ready:
                while self.launch.outbox.poll(0):
                    try:
                        self._handle(p.decode_from_core(self.launch.outbox.recv()))
                    except Exception:  # our bug: log it, and keep reading (the watchdog too)
                        logger.exception("engine core %d: a message could not be handled", self.launch.dp_rank)
            if (why := self._watchdog(step_running)) is not None:
                self._die(why)

    def _handle(self, message: p.FromCore) -> None:
        if isinstance(message, p.Outputs):
            outputs, stops = self._outputs.process(message.outputs)
            for hit in stops:
                self.launch.send(p.StopSequence(hit.request_id, hit.index, hit.stop, hit.num_output_tokens))
            batch: list[tuple[str, Result]] = [(o.request_id, o) for o in outputs]
            batch += [(e.request_id, PluginFailed(e.message) if e.kind == "plugin" else EngineError(e.message))
                      for e in message.errors]
            for e in message.errors:
                self._outputs.forget(e.request_id)
            # After processing: an output that came after its request's abort is not kept either.
            while self._aborted:
                self._outputs.forget(self._aborted.popleft())
            self._call_soon(self._deliver, batch)
        elif isinstance(message, p.GrammarDone):
            future = self._compiles.pop(message.key, None)
            if future is not None and not future.done():
                if message.error_kind is None:
                    future.set_result(None)
                else:
                    future.set_exception({"invalid": ValueError, "timeout": TimeoutError, "closed": CompilerClosed,
                                          "plugin": PluginError}.get(message.error_kind, RuntimeError)(message.message))
        elif isinstance(message, p.UtilityDone):
            future = self._calls.pop(message.key, None)
            if future is not None and not future.done():
                if message.error_kind is None:
                    future.set_result(p.unpack(message.result))
                else:
                    future.set_exception((ValueError if message.error_kind == "invalid" else EngineError)(message.message))
        elif isinstance(message, p.Dead):
            self._die(message.reason)

    def _watchdog(self, step_running: float) -> str | None:
        """Why the core is dead, or None while it lives and steps."""
        if self._closing.is_set():
            return None
        core = f"engine core {self.launch.dp_rank} (pid {self.pid})"
        if (ended := self.launch.ended()) is not None:
            return f"{core} {ended}"
        silent = time.monotonic() - self.last_beat
        if silent > self.step_timeout:
            return f"{core} sent no heartbeat for {silent:.1f} s (step_timeout={self.step_timeout:g} s): stopped or hung"
        if step_running + silent > self.step_timeout:
            return (f"{core}: one step has run for {step_running + silent:.1f} s, past step_timeout="
                    f"{self.step_timeout:g} s: a rank or a collective is hung")
        return None

    def _die(self, reason: str) -> None:
        """(reader thread) The core cannot serve: kill its process group, end what it ran."""
        logger.error("engine dead: %s; failing the requests in flight", reason)
        self._dying = reason
        self.launch.kill()
        self._fail_compiles(reason)
        self._call_soon(self._engine_died, reason)

    def _fail_compiles(self, reason: str) -> None:
        """End every compile and utility call still waiting: the core will not answer them."""
        for waiting, error in ((self._compiles, CompilerClosed), (self._calls, EngineStopped)):
            for key in list(waiting):
                future = waiting.pop(key, None)
                if future is not None and not future.done():
                    future.set_exception(error(f"the engine stopped: {reason}"))

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[union-attr]
        except RuntimeError:  # the loop closed under us during shutdown
            pass


__all__ = ["EngineProcess", "EngineStartError", "EngineStopped", "start_engine_processes"]
