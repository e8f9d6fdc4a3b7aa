"""The messages between an API server and an engine-core process (``core_process.py``).

Transport: ZMQ sockets (PUSH/PULL, one way each) carrying msgspec MessagePack. ZMQ, as vLLM's
engine core uses it: message framing, queueing while a peer is busy, ipc:// on one machine and
tcp:// across machines with the same code; msgspec: typed, versioned structs that decode
several times faster than pickle. A step's outputs are token ids, logprob ids and values and
finish reasons (CoreOutput), never text: the API server's output processor
(``modserve.engine.output_processor``) detokenizes them and searches them for stop strings, and
tells the core where a stop string ended a sequence (StopSequence). The payloads that are the
engine's own Python objects (SamplingParams, EngineLimits, a grammar spec) travel pickled inside a
``bytes`` field: both ends run the same modserve, and these objects carry nested dataclasses,
enums and tensors-free lists that would otherwise need a schema of their own each.

Server -> core (the core's ``inbox``): Start, Add, Abort, StopSequence, CompileGrammar, StopCompiles,
Utility, Shutdown. Core -> server (``outbox``): Hello, Ready, Outputs, GrammarDone, UtilityDone, Dead, Failed.
Core -> server (``beats``, from a thread of its own): Heartbeat, while the core process runs.
"""

from __future__ import annotations

import pickle
from typing import Any, Union

import msgspec

PROTOCOL_VERSION = 2  # 2: outputs as token ids (CoreOutput), StopSequence


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


class StopSequence(msgspec.Struct, tag=True):
    """The API server found a stop string in sample ``index``'s text: the core ends it there,
    keeping ``num_output_tokens`` (the tokens it sampled since are dropped)."""
    request_id: str
    index: int
    stop: str
    num_output_tokens: int


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


ToCore = Union[Start, Add, Abort, StopSequence, CompileGrammar, StopCompiles, Utility, Shutdown]


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


class SampleOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sample's news since its request's last CoreOutput."""
    index: int
    token_ids: list[int]  # the new output tokens
    logprobs: list[dict[str, Any]] | None = None  # their entries (ids and values), with params.logprobs
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step (or an abort, an error) changed of a request, as token ids (vLLM's
    EngineCoreOutput); mutable: the engine sets ``error`` on a failed request's."""
    request_id: str
    samples: list[SampleOutput]
    time: float | None = None  # when the step's tokens were read; None: made outside a step (an abort)
    num_cached_tokens: int = 0
    scheduled_time: float | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # the prompt entries scored since the last one
    finished: bool = False  # every sample ended, as the core sees it (it lets go of the request)
    error: str | None = None
    error_kind: str | None = None


class Outputs(msgspec.Struct, tag=True):
    outputs: list[CoreOutput]
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


def pack(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes) -> Any:
    return pickle.loads(data)
