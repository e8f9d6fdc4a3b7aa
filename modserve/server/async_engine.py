"""AsyncEngine: an LLMEngine stepping in one background thread of the server's process, fed
from asyncio (the offline-style, in-process way; ``modserve serve`` runs the engine in
processes of its own: engine_process.py).

NOTE: only the engine thread ever touches the LLMEngine. The event loop talks to
it through a thread-safe command queue (add, abort, stats, stop), and the thread
hands results back with one ``loop.call_soon_threadsafe`` per step. Everything
on the asyncio side (routes, the waiting count: EngineFrontend) is touched only by the
loop. The loop reads only what was taken from the engine before its thread started: its
limits (immutable) and its grammar compiler (thread-safe).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from modserve.core.structured_outputs import GrammarSpec
from modserve.engine.engine import EngineDeadError, LLMEngine
from modserve.engine.grammar_compile import CompiledGrammar
from modserve.engine.intra_op_threads import release_intra_op_threads
# The names below are this module's API since before engine_frontend.py held them.
from modserve.server.engine_frontend import (DEAD_MESSAGE, AbortRequest, AddRequest, Aborts, EngineDead,  # noqa: F401
                                             EngineError, EngineFrontend, EngineStopped, PluginFailed,
                                             RequestObserver, RequestStream, Result, ShuttingDown, StreamStalled,
                                             engine_error)

logger = logging.getLogger("modserve.server")

# Seconds an idle engine thread waits for a command before it asks the engine whether its
# tensor-parallel workers are still there (a worker that dies between requests is noticed).
HEALTH_CHECK_INTERVAL = 1.0
# /metrics waits this long for the engine thread to read its stats between steps, then reports
# the last ones it has (a long prefill, or a hung rank, must not hang the scrape).
STATS_WAIT_S = 0.5


@dataclass(slots=True)
class _Stats:
    future: asyncio.Future


@dataclass(slots=True)
class _Utility:
    future: asyncio.Future
    method: str
    args: tuple


class _Stop:
    pass


class AsyncEngine(EngineFrontend):
    """One LLMEngine stepping in a thread of this process (see the module's docstring)."""

    def __init__(self, engine: LLMEngine, observer: RequestObserver | None = None, id_prefix: str = "") -> None:
        super().__init__(engine.config, engine.limits, engine.allocator.num_blocks, observer, id_prefix)
        self.engine = engine
        self._grammar = engine.grammar
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pending_stats: set[asyncio.Future] = set()  # loop thread only

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        if self.dead_reason is not None:
            raise EngineDead(f"the engine stopped: {self.dead_reason}")
        self._loop = asyncio.get_running_loop()
        release_intra_op_threads()  # this thread loaded the model: the engine thread computes from now on
        # the engine thread runs in this context: torch keeps its compile settings in context variables
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._run,),
                                        name="modserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._commands.put(_Stop())
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.0f s", timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self._thread is not None and self._thread.is_alive()

    def shutdown_engine(self) -> None:
        """Stop the engine's tensor-parallel workers, after ``stop()`` (the server's last act).

        NOTE: an engine thread still stuck in a step (stop() timed out) may be inside a
        collective: telling the workers to stop from here would interleave with it, so they
        are killed instead (which ends the stuck step too)."""
        if self._thread is not None and self._thread.is_alive():
            logger.warning("the engine thread is still running a step: killing its workers")
            self._grammar.close()
            self.engine.executor.shutdown()
        else:
            self.engine.shutdown()

    # -- loop side ------------------------------------------------------------------------
    def _send(self, command: AddRequest | AbortRequest) -> None:
        self._commands.put(command)

    async def stats(self) -> dict[str, Any]:
        """engine.stats(), read on the engine thread between steps; the last ones read when
        that takes longer than STATS_WAIT_S."""
        if not self.alive:
            return self.last_stats
        future = asyncio.get_running_loop().create_future()
        self._pending_stats.add(future)
        self._commands.put(_Stats(future))
        try:
            self.last_stats = await asyncio.wait_for(asyncio.shield(future), STATS_WAIT_S)
        except TimeoutError:
            pass  # the engine is in a long step: what it said last
        finally:
            self._pending_stats.discard(future)
        return self.last_stats

    async def call_utility(self, method: str, *args: Any) -> Any:
        if not self.alive:
            raise EngineDead("the engine is not running")
        future = asyncio.get_running_loop().create_future()
        self._commands.put(_Utility(future, method, args))
        return await future

    def compile_grammar(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        return self._grammar.submit(spec)  # thread-safe: no need to wait for the engine thread

    def stop_compiles(self) -> None:
        self._grammar.close()

    def _engine_died(self, reason: str) -> None:
        super()._engine_died(reason)
        for future in self._pending_stats:
            _resolve(future, self.last_stats)

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            self._loop_steps()
        except EngineDeadError as e:  # a worker is gone: no step can run again
            logger.error("engine dead: %s; failing the %d requests in flight and stopping", e,
                         len(engine.requests))
            self._fail_all(EngineStopped(f"the engine stopped: {e}"))
            self._call_soon(self._engine_died, str(e))
        for rid in list(engine.requests):  # stopped with requests in flight: free their blocks
            engine.abort_request(rid)

    def _loop_steps(self) -> None:
        engine = self.engine
        while True:
            # Block only when there is nothing to step: a busy engine just drains what came in.
            idle = not engine.has_unfinished_requests()
            if not self._drain(block=idle):
                return
            if idle and not engine.has_unfinished_requests():
                engine.check_health()  # cheap; EngineDeadError when a worker died meanwhile
                continue
            try:
                outputs = engine.step()
            except EngineDeadError:
                raise
            except Exception as e:  # one bad step must not take the server down
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all(engine_error(e, "the engine failed"))
                continue
            if outputs:
                self._emit([(o.request_id, o) for o in outputs])

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; False once told to stop. Blocking, it waits at most
        HEALTH_CHECK_INTERVAL for the first."""
        while True:
            try:
                command = self._commands.get(block=block, timeout=HEALTH_CHECK_INTERVAL if block else None)
            except queue.Empty:
                return True
            block = False
            if isinstance(command, _Stop):
                return False
            try:
                self._apply(command)
            except Exception:
                logger.exception("engine command %s failed", type(command).__name__)

    def _apply(self, command: Any) -> None:
        engine = self.engine
        if isinstance(command, AddRequest):
            try:
                engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                   command.arrival_time, command.priority, command.lora_request)
            except Exception as e:  # goes to that request alone
                self._emit([(command.request_id, engine_error(e, "the engine refused the request"))])
        elif isinstance(command, AbortRequest):
            engine.abort_request(command.request_id)
        elif isinstance(command, _Utility):
            try:
                self._call_soon(_resolve, command.future, getattr(engine, command.method)(*command.args))
            except Exception as e:  # the caller's to handle
                self._call_soon(_resolve, command.future, None, e)
        elif isinstance(command, _Stats):
            try:
                self._call_soon(_resolve, command.future, engine.stats())
            except Exception as e:
                self._call_soon(_resolve, command.future, None, e)
                raise

    def _fail_all(self, error: EngineError) -> None:
        failed = list(self.engine.requests)
        for rid in failed:
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("could not abort %s after a failed step", rid)
        self._emit([(rid, error) for rid in failed])

    def _emit(self, batch: list[tuple[str, Result]]) -> None:
        self._call_soon(self._deliver, batch)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[union-attr]
        except RuntimeError:  # the loop closed under us during shutdown
            pass


def _resolve(future: asyncio.Future, value: Any, error: BaseException | None = None) -> None:
    if future.done():  # its caller gave up waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
