"""AsyncEngine: an LLMEngine stepping in one background thread, fed from asyncio.

NOTE: only the engine thread ever touches the LLMEngine. The event loop talks to
it through a thread-safe command queue (add, abort, stats, stop), and the thread
hands results back with one ``loop.call_soon_threadsafe`` per step. Everything
on the asyncio side (routes, the waiting count) is touched only by the loop. The
loop reads only what was taken from the engine before its thread started: its
limits (immutable) and its grammar compiler (thread-safe).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Callable, Protocol

from modserve.engine.client import EngineClient, OutputStream
from modserve.engine.engine import EngineDeadError, LLMEngine
from modserve.engine.grammar_compile import CompiledGrammar
from modserve.core.outputs import RequestOutput
from modserve.core.registry import PluginError
from modserve.core.sampling_params import SamplingParams
from modserve.core.structured_outputs import GrammarSpec

logger = logging.getLogger("modserve.server")

# What the engine thread hands to a request: its latest cumulative output, or the error that ended it.
Result = RequestOutput | BaseException
# Seconds an idle engine thread waits for a command before it asks the engine whether its
# tensor-parallel workers are still there (a worker that dies between requests is noticed).
HEALTH_CHECK_INTERVAL = 1.0
# What a client is told once the engine died (the reason, with ranks and pids, is logged).
DEAD_MESSAGE = "the engine stopped: a tensor-parallel worker failed (the server logged why); restart the server"


class EngineError(RuntimeError):
    """The engine failed while running a request; the request is over, the server is not."""


class PluginFailed(EngineError):
    """A plugin broke its contract while running this request; the message (a PluginError's)
    names it. The request is over, the server and the other requests are not."""


def engine_error(e: Exception, what: str) -> EngineError:
    """``e`` as the error a request ends with: a PluginError keeps its message (it names the plugin)."""
    if isinstance(e, EngineError):
        return e
    return PluginFailed(str(e)) if isinstance(e, PluginError) else EngineError(f"{what}: {e}")


class EngineDead(RuntimeError):
    """The engine thread is not running (stopped, or never started)."""


class EngineStopped(EngineError):
    """The engine cannot go on (a tensor-parallel worker is gone): every request in flight
    ends with this, the engine thread stops, and the server reports itself unhealthy."""


class ShuttingDown(EngineError):
    """The server's drain timeout ran out before this request finished."""


class StreamStalled(EngineError):
    """The stream's client left its output unread for stream_stall_timeout: its requests were
    aborted, so that a client that does not read holds no sequence of the batch."""


class RequestObserver(Protocol):
    """Told about every request's end (metrics listen here)."""

    def request_finished(self, output: RequestOutput) -> None: ...

    def request_ended_early(self, reason: str) -> None: ...


class Aborts(Protocol):
    """What a RequestStream ends its requests through: an AsyncEngine, or a ReplicaSet."""

    def abort(self, request_id: str, reason: str = "abort") -> None: ...


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Stats:
    future: asyncio.Future


class _Stop:
    pass


class AsyncEngine(EngineClient):
    """``id_prefix`` starts every request id after ``req-``: a ReplicaSet gives each replica its
    own, so that ids are unique across the set and an abort by id reaches only the holder."""

    def __init__(self, engine: LLMEngine, observer: RequestObserver | None = None, id_prefix: str = "") -> None:
        self.engine = engine
        self.observer = observer
        self.limits = engine.limits
        self._grammar = engine.grammar
        self.stall_timeout = engine.config.stream_stall_timeout
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._routes: dict[str, RequestStream] = {}  # loop thread only
        self._waiting: set[str] = set()  # submitted, no output yet; loop thread only
        self._id_prefix = id_prefix
        self._ids = count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.last_stats: dict[str, Any] = {}
        # Why the engine died (EngineDeadError's message), once the loop thread knows it.
        self._dead_reason: str | None = None
        self._pending_stats: set[asyncio.Future] = set()  # loop thread only

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        if self.dead_reason is not None:
            raise EngineDead(f"the engine stopped: {self.dead_reason}")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="modserve-engine", daemon=True)
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

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

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

    @property
    def num_waiting(self) -> int:
        """Requests accepted that have not produced their first token yet."""
        return len(self._waiting)

    # -- loop side ------------------------------------------------------------------------
    def submit(self, prompts: list[list[int]], params: SamplingParams,
               arrival_time: float | None = None, priority: int = 0) -> "RequestStream":
        """One engine request per prompt, all answered through one stream."""
        stream = RequestStream(self, self.new_request_ids(len(prompts)), self.stall_timeout)
        self.add(stream, stream.request_ids, prompts, params, arrival_time, priority)
        return stream

    def new_request_ids(self, num: int) -> list[str]:
        batch = f"{self._id_prefix}{next(self._ids)}"
        return [f"req-{batch}-{i}" for i in range(num)]

    def add(self, stream: "RequestStream", request_ids: list[str], prompts: list[list[int]],
            params: SamplingParams, arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue one engine request per prompt, named ``request_ids``, its outputs put to ``stream``
        (which may also take other engines' requests: see ReplicaSet)."""
        if not self.alive:
            raise EngineDead(DEAD_MESSAGE if self.dead_reason is not None else "the engine is not running")
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        for rid, token_ids in zip(request_ids, prompts):
            self._routes[rid] = stream
            self._waiting.add(rid)
            self._commands.put(_Add(rid, token_ids, params, arrival, priority))

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request that has not finished; ``reason`` is what /metrics counts it as."""
        if self._routes.pop(request_id, None) is None:
            return  # already finished, failed or aborted
        self._waiting.discard(request_id)
        self._commands.put(_Abort(request_id))
        if self.observer:
            self.observer.request_ended_early(reason)

    async def stats(self) -> dict[str, Any]:
        """engine.stats(), read on the engine thread between steps."""
        if not self.alive:
            return self.last_stats
        future = asyncio.get_running_loop().create_future()
        self._pending_stats.add(future)
        self._commands.put(_Stats(future))
        try:
            self.last_stats = await future
        finally:
            self._pending_stats.discard(future)
        return self.last_stats

    @property
    def num_in_flight(self) -> int:
        """Engine requests submitted and not yet ended (loop thread)."""
        return len(self._routes)

    def cancel_all(self, error: Exception) -> None:
        """End every request in flight with ``error`` (loop thread): their streams raise it,
        and the engine aborts them, freeing their blocks."""
        ids = list(self._routes)
        self._deliver([(rid, error) for rid in ids])
        for rid in ids:
            self._commands.put(_Abort(rid))

    def compile_grammar(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        return self._grammar.submit(spec)  # thread-safe: no need to wait for the engine thread

    def stop_compiles(self) -> None:
        self._grammar.close()

    def _deliver(self, batch: list[tuple[str, Result]]) -> None:
        for rid, result in batch:
            stream = self._routes.get(rid)
            if stream is None:
                continue  # aborted while this step ran
            self._waiting.discard(rid)
            if isinstance(result, RequestOutput) and result.error is not None:
                # A fault inside a step, traced to this request alone: the others went on.
                result = (PluginFailed(result.error) if result.error_kind == "plugin"
                          else EngineError(f"the engine failed on this request: {result.error}"))
            ended = isinstance(result, BaseException) or result.finished
            if ended:
                del self._routes[rid]
                if self.observer:
                    if isinstance(result, BaseException):
                        self.observer.request_ended_early("error")
                    else:
                        self.observer.request_finished(result)
            stream.put(rid, result)

    def _engine_died(self, reason: str) -> None:
        """(loop thread) The engine thread ended on an EngineDeadError: no request is taken
        any more, and whatever waits on the engine thread is answered now."""
        self._dead_reason = reason
        error = EngineStopped(f"the engine stopped: {reason}")
        self._deliver([(rid, error) for rid in list(self._routes)])  # submitted after its last look
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
        if isinstance(command, _Add):
            try:
                engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                   command.arrival_time, command.priority)
            except Exception as e:  # goes to that request alone
                self._emit([(command.request_id, engine_error(e, "the engine refused the request"))])
        elif isinstance(command, _Abort):
            engine.abort_request(command.request_id)
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


@dataclass(eq=False)
class RequestStream(OutputStream):
    """The outputs of the engine requests one HTTP request made, as they come.

    Iterating yields RequestOutputs (cumulative, as the engine makes them). Only each
    request's latest unread output is kept: a reader that falls behind holds one output
    per request, never one per step. ``close()`` aborts whatever has not finished; it is
    safe to call twice.

    NOTE: a reader that takes nothing for ``stall_timeout`` seconds (0: never) while outputs
    wait is a route blocked sending to a client that does not read. At the next output
    after that, the stream aborts its requests (they leave the batch, their KV is freed)
    and the reader, once it reads again, gets StreamStalled.
    """

    engine: Aborts
    request_ids: list[str]
    stall_timeout: float = 0.0
    _unread: dict[str, Result] = field(default_factory=dict)
    _unread_since: float | None = None  # when the oldest unread output arrived (monotonic)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _ready: deque = field(default_factory=deque)
    _unfinished: set[str] = field(init=False)
    _positions: dict[str, int] = field(init=False)
    _stalled: StreamStalled | None = None

    def __post_init__(self) -> None:
        self._unfinished = set(self.request_ids)
        self._positions = {rid: i for i, rid in enumerate(self.request_ids)}

    def index(self, request_id: str) -> int:
        """The position of ``request_id``'s prompt in the request."""
        return self._positions[request_id]

    def put(self, request_id: str, result: Result) -> None:
        self._unread[request_id] = result
        self._arrived.set()
        now = time.monotonic()
        if self._unread_since is None:
            self._unread_since = now
        elif self.stall_timeout and now - self._unread_since > self.stall_timeout and self._unfinished:
            self._stall(now - self._unread_since)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._ready:
            if self._stalled is not None:
                raise self._stalled
            if not self._unfinished:
                raise StopAsyncIteration
            if not self._unread:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            self._ready.extend(self._unread.items())
            self._unread.clear()
            self._unread_since = None
        rid, result = self._ready.popleft()
        if isinstance(result, BaseException):
            self._unfinished.discard(rid)
            self.close()
            raise result
        if result.finished:
            self._unfinished.discard(rid)
        return result

    def close(self) -> None:
        for rid in self._unfinished:
            self.engine.abort(rid)
        self._unfinished.clear()

    def _stall(self, waited: float) -> None:
        logger.warning("a stream's client read nothing for %.1f s (stream_stall_timeout=%g s): aborting its "
                       "requests %s", waited, self.stall_timeout, ", ".join(sorted(self._unfinished)))
        self._stalled = StreamStalled(f"the client read nothing of this stream for stream_stall_timeout="
                                      f"{self.stall_timeout:g} s: it was aborted")
        for rid in self._unfinished:
            self.engine.abort(rid, "stalled")
        self._unfinished.clear()
        self._unread.clear()
        self._ready.clear()
        self._arrived.set()
