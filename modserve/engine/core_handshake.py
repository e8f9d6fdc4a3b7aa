"""The handshake of an engine core on another machine (``modserve serve --headless``) with the
API server that serves it (vLLM's ``--data-parallel-address``/``--data-parallel-rpc-port``).

The API server binds a ROUTER socket on ``tcp://ADDRESS:RPC_PORT``. Each remote core connects
a DEALER to it and sends a Handshake: its data-parallel rank, the protocol version, and the
fingerprint of the config it was started with. The server answers Welcome (the tcp addresses
of the core's inbox, outbox and beats, bound for that rank) or Refused (why, naming what
differs). After Welcome the core runs exactly as a core on the server's machine does.

NOTE: every node reads its own command line and its own copy of the checkpoint (at any path):
the fingerprint compares what must be equal for the ranks to answer as one engine does, and
leaves out what is each machine's own (paths, device, threads, KV cache size).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Union

import msgspec

# Each machine's own: may differ between the API server's node and a headless one.
NODE_LOCAL_KEYS = frozenset({"model", "tokenizer", "device", "num_threads", "kv_cache_memory_fraction",
                             "kv_cache_memory_gb", "num_kv_blocks", "master_port"})
SHOWN_CHARS = 80  # a differing value is shown up to this long in the refusal


class Handshake(msgspec.Struct, tag=True):
    dp_rank: int
    version: int  # core_protocol.PROTOCOL_VERSION of the core's modserve
    fingerprint: dict[str, str]  # config key -> its value as JSON (fingerprint())
    host: str  # the core's machine, for the server's log


class Welcome(msgspec.Struct, tag=True):
    inbox: str  # tcp:// addresses bound by the server for this rank
    outbox: str
    beats: str


class Refused(msgspec.Struct, tag=True):
    reason: str


Answer = Union[Welcome, Refused]
_encoder = msgspec.msgpack.Encoder()
_handshake = msgspec.msgpack.Decoder(Handshake)
_answer = msgspec.msgpack.Decoder(Answer)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_handshake(data: bytes) -> Handshake:
    return _handshake.decode(data)


def decode_answer(data: bytes) -> Answer:
    return _answer.decode(data)


def fingerprint(config: Any) -> dict[str, str]:
    """What of ``config`` (an EngineConfig, every rank's base one) must match between nodes: its
    keys but the node-local ones, and the checkpoint by its config.json's content, not its path."""
    data = config.model_dump(mode="json")
    out = {k: json.dumps(v, sort_keys=True) for k, v in data.items() if k not in NODE_LOCAL_KEYS}
    checkpoint = Path(str(data.get("model") or "")) / "config.json"
    try:
        out["checkpoint config.json"] = hashlib.sha256(
            json.dumps(json.loads(checkpoint.read_text()), sort_keys=True).encode()).hexdigest()[:16]
    except (OSError, ValueError):
        out["checkpoint config.json"] = "unreadable"
    return out


def differences(server: dict[str, str], core: dict[str, str]) -> list[str]:
    """Each key whose value differs, as ``key (API server: X, this rank: Y)``."""
    def shown(v: str | None) -> str:
        return "unset" if v is None else v if len(v) <= SHOWN_CHARS else v[:SHOWN_CHARS] + "..."

    return [f"{k} (API server: {shown(server.get(k))}, this rank: {shown(core.get(k))})"
            for k in sorted(server.keys() | core.keys()) if server.get(k) != core.get(k)]
