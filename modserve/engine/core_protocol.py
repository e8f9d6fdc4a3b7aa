"""The messages between an API server and an engine-core process (``core_process.py``).

Transport: ZMQ sockets (PUSH/PULL, one way each) carrying msgspec MessagePack. ZMQ, as vLLM's
engine core uses it: message framing, queueing while a peer is busy, ipc:// on one machine and
tcp:// across machines with the same code; msgspec: typed, versioned structs that decode
several times faster than pickle. The payloads that are the engine's own Python objects
(SamplingParams, RequestOutput, EngineLimits, a grammar spec) travel pickled inside a
``bytes`` field: both ends run the same modserve, and these objects carry nested dataclasses,
enums and tensors-free lists that would otherwise need a schema of their own each.

Server -> core (the core's ``inbox``): Start, Add, Abort, CompileGrammar, StopCompiles, Utility,
Shutdown. Core -> server (``outbox``): Hello, Ready, Outputs, GrammarDone, UtilityDone, Dead, Failed.
Core -> server (``beats``, from a thread of its own): Heartbeat, while the core process runs.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Union

import msgspec

from modserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput

PROTOCOL_VERSION = 1


# -- server -> core -------------------------------------------------------------------------------
class Start(msgspec.Struct, tag=True):
    """Build the engine now (cores are started together but build one at a time: each sizes
    its KV cache on the memory the ones before left)."""


class Add(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: bytes  # pickled SamplingParams
    arrival_time: float
    priority: int
    lora: bytes = b""  # pickled LoRARequest; empty: the base model


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class CompileGrammar(msgspec.Struct, tag=True):
    key: int  # echoed in GrammarDone
    spec: bytes  # pickled GrammarSpec


class StopCompiles(msgspec.Struct, tag=True):
    pass


class Utility(msgspec.Struct, tag=True):
    """Call ``engine.<method>(*args)`` between steps; answered by UtilityDone."""
    key: int
    method: str  # one of UTILITY_METHODS
    args: bytes  # pickled tuple


# The engine methods a server may call through Utility (vLLM's engine core has the same door).
UTILITY_METHODS = frozenset({"embed", "stats", "add_lora", "remove_lora", "kv_transfer_params"})


class Shutdown(msgspec.Struct, tag=True):
    pass


ToCore = Union[Start, Add, Abort, CompileGrammar, StopCompiles, Utility, Shutdown]


# -- core -> server -------------------------------------------------------------------------------
class Hello(msgspec.Struct, tag=True):
    """The core process runs and reached its sockets (sent before it builds anything)."""
    pid: int
    version: int = PROTOCOL_VERSION


class Ready(msgspec.Struct, tag=True):
    limits: bytes  # pickled EngineLimits
    num_kv_blocks: int


class Failed(msgspec.Struct, tag=True):
    """The engine could not be built; the core exits after sending this."""
    error: str


class RequestError(msgspec.Struct):
    request_id: str
    kind: str  # "plugin": a plugin broke its contract; "engine": anything else
    message: str


class Outputs(msgspec.Struct, tag=True):
    outputs: list[bytes]  # each a request's output: whole the first time, then what changed (OutputDeltas)
    errors: list[RequestError] = []


class GrammarDone(msgspec.Struct, tag=True):
    key: int
    error_kind: str | None = None  # None (compiled), "invalid", "timeout", "closed", "plugin", "other"
    message: str = ""


class UtilityDone(msgspec.Struct, tag=True):
    key: int
    result: bytes = b""  # pickled return value
    error_kind: str | None = None  # None (returned), "invalid" (ValueError), "other"
    message: str = ""


class Dead(msgspec.Struct, tag=True):
    """The engine cannot step again (a rank is gone); the core exits after sending this."""
    reason: str


class Heartbeat(msgspec.Struct, tag=True):
    step_running_s: float  # how long the step now running has run; 0 between steps
    stats: bytes  # pickled engine.stats() as last read between steps
    stats_age_s: float


FromCore = Union[Hello, Ready, Failed, Outputs, GrammarDone, UtilityDone, Dead, Heartbeat]

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)


# -- outputs as deltas ------------------------------------------------------------------------------
@dataclass(slots=True)
class _Delta:
    """What changed in a request's output since the one sent before it."""
    request_id: str
    finished: bool
    completions: list[tuple]  # (index, text, token_ids, logprobs, finish_reason, stop_reason): the new parts
    token_times: list[float]
    first_token_time: float | None
    finished_time: float | None
    scheduled_time: float | None
    num_cached_tokens: int
    error: str | None
    error_kind: str | None


class OutputDeltas:
    """Each request's output, sent whole the first time, then as what changed.

    The engine's outputs are cumulative: every step's holds the prompt (and its logprobs) and
    every token so far. Sent whole each step, a request with prompt logprobs of a long prompt
    would cost its whole size per step. The core's instance ``encode``s; the server's
    ``decode``s into whole, new RequestOutputs again; each ``forget``s a request that ends.
    """

    def __init__(self) -> None:
        self._sent: dict[str, tuple[list[tuple[int, int, int]], int]] = {}  # core: lengths sent
        self._whole: dict[str, RequestOutput] = {}  # server: the last output rebuilt

    def encode(self, out: RequestOutput) -> bytes:
        prev = self._sent.pop(out.request_id, None)
        if not out.finished:
            self._sent[out.request_id] = ([(len(c.text), len(c.token_ids), len(c.logprobs or ())) for c in out.outputs],
                                          len(out.metrics.token_times))
        if prev is None or len(prev[0]) != len(out.outputs) or any(
                len(c.text) < t or len(c.token_ids) < n for c, (t, n, _) in zip(out.outputs, prev[0])):
            return pack(out)
        m = out.metrics
        parts = [(c.index, c.text[t:], c.token_ids[n:], None if c.logprobs is None else c.logprobs[k:],
                  c.finish_reason, c.stop_reason) for c, (t, n, k) in zip(out.outputs, prev[0])]
        return pack(_Delta(out.request_id, out.finished, parts, m.token_times[prev[1]:], m.first_token_time,
                           m.finished_time, m.scheduled_time, out.num_cached_tokens, out.error, out.error_kind))

    def decode(self, data: bytes) -> RequestOutput | None:
        """The whole output again; None for a delta of a request forgotten here (aborted)."""
        got = unpack(data)
        if isinstance(got, _Delta):
            base = self._whole.get(got.request_id)
            if base is None:
                return None
            got = _apply(base, got)
        if got.finished:
            self._whole.pop(got.request_id, None)
        else:
            self._whole[got.request_id] = got
        return got

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._whole.pop(request_id, None)


def _apply(base: RequestOutput, d: _Delta) -> RequestOutput:
    outputs = [CompletionOutput(index, old.text + text, old.token_ids + token_ids, finish_reason, stop_reason,
                                None if logprobs is None else (old.logprobs or []) + logprobs)
               for old, (index, text, token_ids, logprobs, finish_reason, stop_reason) in zip(base.outputs,
                                                                                              d.completions)]
    m = base.metrics
    metrics = RequestMetrics(m.arrival_time, d.first_token_time, d.finished_time, m.token_times + d.token_times,
                             d.scheduled_time)
    return RequestOutput(base.request_id, base.prompt, base.prompt_token_ids, outputs, d.finished, metrics,
                         d.num_cached_tokens, base.prompt_logprobs, d.error, d.error_kind)  # type: ignore[arg-type]


def pack(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes) -> Any:
    return pickle.loads(data)
