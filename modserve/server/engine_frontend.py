"""The server's side of an engine, wherever the engine steps: request ids, the route from each
request to its RequestStream, the waiting count, and the errors a request can end with.

:class:`EngineFrontend` holds all of it on the event loop's thread; a subclass says how
commands reach the engine and how its outputs come back: ``AsyncEngine`` (a thread of this
process) or ``EngineProcess`` (an engine-core process over ZMQ). Both hand each batch of
outputs to ``_deliver`` on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import abstractmethod
from collections import deque
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Protocol

from modserve.core.config import EngineConfig
from modserve.core.lora_request import LoRARequest
from modserve.core.outputs import RequestOutput
from modserve.core.registry import PluginError
from modserve.core.sampling_params import SamplingParams
from modserve.engine.client import EngineClient, OutputStream
from modserve.engine.limits import EngineLimits

logger = logging.getLogger("modserve.server")

# What the engine hands to a request: its latest cumulative output, or the error that ended it.
Result = RequestOutput | BaseException
# What a client is told once the engine died (the reason, with ranks and pids, is logged).
DEAD_MESSAGE = ("the engine stopped: an engine process or a tensor-parallel worker failed or hung (the server "
                "logged why)")


class EngineError(RuntimeError):
    """The engine failed while running a request; the request is over, the server is not."""


class PluginFailed(EngineError):
    """A plugin broke its contract while running this request; the message (a PluginError's)
    names it. The request is over, the server and the other requests are not."""


class KVLoadFailed(EngineError):
    """The KV connector could not load this request's blocks (kv_load_failure_policy: fail); the
    message names the connector and how many blocks. Another replica may hold them or compute them."""


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
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class AbortRequest:
    request_id: str



class EngineFrontend(EngineClient):
    """The loop side of one engine. ``id_prefix`` starts every request id after ``req-``: a
    ReplicaSet gives each replica its own, so that ids are unique across the set and an abort
    by id reaches only the holder. Subclasses send commands with ``_send`` and hand outputs
    to ``_deliver`` on the loop; ``_engine_died`` once the engine cannot go on."""

    def __init__(self, config: EngineConfig, limits: EngineLimits, num_kv_blocks: int,
                 observer: RequestObserver | None = None, id_prefix: str = "") -> None:
        self.config = config
        self.limits = limits
        self.num_kv_blocks = num_kv_blocks  # the router sizes its prefix index on it
        self.observer = observer
        self.stall_timeout = config.stream_stall_timeout
        self._routes: dict[str, RequestStream] = {}  # loop thread only
        self._waiting: set[str] = set()  # submitted, no output yet; loop thread only
        self._id_prefix = id_prefix
        self._ids = count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.last_stats: dict[str, Any] = {}
        self._dead_reason: str | None = None  # why the engine died, once the loop thread knows it

    @abstractmethod
    def _send(self, command: AddRequest | AbortRequest) -> None:
        """Hand ``command`` to the engine (never waits for its step)."""

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def num_waiting(self) -> int:
        """Requests accepted that have not produced their first token yet."""
        return len(self._waiting)

    @property
    def num_in_flight(self) -> int:
        """Engine requests submitted and not yet ended (loop thread)."""
        return len(self._routes)

    def submit(self, prompts: list[list[int]], params: SamplingParams, arrival_time: float | None = None,
               priority: int = 0, lora_request: LoRARequest | None = None) -> "RequestStream":
        """One engine request per prompt, all answered through one stream."""
        stream = RequestStream(self, self.new_request_ids(len(prompts)), self.stall_timeout)
        self.add(stream, stream.request_ids, prompts, params, arrival_time, priority, lora_request)
        return stream

    def new_request_ids(self, num: int) -> list[str]:
        batch = f"{self._id_prefix}{next(self._ids)}"
        return [f"req-{batch}-{i}" for i in range(num)]

    def add(self, stream: "RequestStream", request_ids: list[str], prompts: list[list[int]],
            params: SamplingParams, arrival_time: float | None = None, priority: int = 0,
            lora_request: LoRARequest | None = None) -> None:
        """Queue one engine request per prompt, named ``request_ids``, its outputs put to ``stream``
        (which may also take other engines' requests: see ReplicaSet)."""
        if not self.alive:
            raise EngineDead(DEAD_MESSAGE if self.dead_reason is not None else "the engine is not running")
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        for rid, token_ids in zip(request_ids, prompts):
            self._routes[rid] = stream
            self._waiting.add(rid)
            self._send(AddRequest(rid, token_ids, params, arrival, priority, lora_request))

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request that has not finished; ``reason`` is what /metrics counts it as."""
        if self._routes.pop(request_id, None) is None:
            return  # already finished, failed or aborted
        self._waiting.discard(request_id)
        self._send(AbortRequest(request_id))
        if self.observer:
            self.observer.request_ended_early(reason)

    def cancel_all(self, error: Exception) -> None:
        """End every request in flight with ``error`` (loop thread): their streams raise it,
        and the engine aborts them, freeing their blocks."""
        ids = list(self._routes)
        self._deliver([(rid, error) for rid in ids])
        for rid in ids:
            self._send(AbortRequest(rid))

    def _deliver(self, batch: list[tuple[str, Result]]) -> None:
        for rid, result in batch:
            stream = self._routes.get(rid)
            if stream is None:
                continue  # aborted while this step ran
            self._waiting.discard(rid)
            if isinstance(result, RequestOutput) and result.error is not None:
                # A fault inside a step, traced to this request alone: the others went on.
                result = (PluginFailed(result.error) if result.error_kind == "plugin"
                          else KVLoadFailed(result.error) if result.error_kind == "kv_load"
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
        """(loop thread) The engine cannot go on: no request is taken any more, and every one
        in flight ends with EngineStopped."""
        self._dead_reason = reason
        error = EngineStopped(f"the engine stopped: {reason}")
        self._deliver([(rid, error) for rid in list(self._routes)])


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
