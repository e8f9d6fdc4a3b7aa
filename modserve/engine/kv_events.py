"""KV cache events on vLLM's wire (``kv_events_config``): after each step the engine takes its
allocator's events and publishes them as one batch, so a prefix-aware router (llm-d, Dynamo)
knows which engine holds which blocks. docs/kv-events.md.

Wire format, as vLLM's ``vllm/distributed/kv_events.py`` (its current layout): a ZMQ PUB
multipart ``(topic, sequence number as 8 bytes big-endian, msgpack payload)``, the payload a
``KVEventBatch`` array ``[ts, events, data_parallel_rank]`` whose events are maps tagged by
``type``: ``{"type": "BlockStored", "block_hashes": ..., "parent_block_hash": ..., "token_ids":
..., "block_size": ..., "lora_id": ..., "medium": ..., "lora_name": ...}``. A ROUTER socket
answers ``[b"", start_seq]`` with every buffered batch from ``start_seq`` on, each ``[b"", topic,
seq, payload]``, then ``[b"", b"", -1, b""]``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Union

import msgspec
import zmq

from modserve.core.config import KVEventsConfig
from modserve.core.contracts import kv_allocator as core
from modserve.core.contracts.kv_allocator import KVAllocator

logger = logging.getLogger("modserve")
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A map whose ``type`` is the class name. NOTE: vLLM up to 0.23 sent events as arrays too
    (``array_like``); its structs since, and so these, are maps (docs/kv-events.md)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: int | None = None


def block_hash(key: str) -> int:
    """A ``block_keys`` key (hex sha256) as the wire's integer: its digest's low 64 bits, unsigned,
    as vLLM's integer block hashes are."""
    return int(key[-16:], 16)


def to_wire(event: core.KVCacheEvent, block_size: int, medium: str) -> KVCacheEvent:
    if isinstance(event, core.BlockStored):
        parent = None if event.parent_key is None else block_hash(event.parent_key)
        return BlockStored([block_hash(k) for k in event.keys], parent, event.token_ids, block_size,
                           event.lora_id, medium, event.lora_name)
    if isinstance(event, core.BlockRemoved):
        return BlockRemoved([block_hash(k) for k in event.keys], medium)
    return AllBlocksCleared()


def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """Data-parallel rank ``rank``'s endpoint, as vLLM offsets it: a tcp port plus the rank (port 0,
    the system's choice, stays 0), an inproc or ipc name with ``_dp<rank>`` appended; rank 0 keeps
    the endpoint."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank if int(port) else 0}"
    raise ValueError(f"kv_events_config: endpoint {endpoint!r} is not tcp://, ipc:// or inproc://")


class ZmqEventPublisher:
    """Encodes and sends batches on a thread of its own, keeping the last ``buffer_steps`` for
    replay. Bounded: at most ``max_queue_size`` batches wait (then ``publish`` waits), at most
    ``buffer_steps`` are kept, and ZMQ drops a slow subscriber's messages past ``hwm``."""

    def __init__(self, config: KVEventsConfig, rank: int) -> None:
        self.rank = rank
        self.topic = config.topic.encode()
        self.pending: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        endpoint = offset_endpoint_port(config.endpoint, rank)
        replay = offset_endpoint_port(config.replay_endpoint, rank)
        self.context = zmq.Context()  # its own: the engine core terms its context when it stops
        self.pub = self.context.socket(zmq.PUB)
        self.replay: zmq.Socket | None = None
        try:
            self.pub.setsockopt(zmq.SNDHWM, config.hwm)
            # As vLLM: bind a wildcard or local endpoint, connect to a named host (a collector).
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self.pub.bind(endpoint)
                endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://*:0: the port it got
            else:
                self.pub.connect(endpoint)
            if replay:
                self.replay = self.context.socket(zmq.ROUTER)
                # NOTE: a ROUTER drops what passes a peer's high-water mark, silently: a whole replay must
                # fit (vLLM's bound: each batch and the end marker, twice over).
                self.replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self.replay.bind(replay)
                replay = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config: data-parallel rank {rank} cannot open {endpoint!r} "
                             f"(replay {replay!r}): {e}") from None
        self.thread = threading.Thread(target=self._run, name=f"modserve-kv-events{rank}", daemon=True)
        self.thread.start()
        logger.info("kv events: publishing on %s%s", endpoint, f", replay on {replay}" if replay else "")

    def publish(self, events: list[KVCacheEvent]) -> None:
        self.pending.put(KVEventBatch(time.time(), events, self.rank))

    def close(self) -> None:
        """Send what is queued (within a second), then close the sockets."""
        try:
            self.pending.put(None, timeout=1.0)
        except queue.Full:
            pass  # the thread is stuck or gone: what is queued is lost with the sockets
        self.thread.join(timeout=1.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self.pub, self.replay):
            if sock is not None:
                sock.close(linger=0)
        self.context.term()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seqs = count()
        while True:
            if self.replay is not None and self.replay.poll(0):
                self._serve_replay()
            try:
                batch = self.pending.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq, payload = next(seqs), encoder.encode(batch)
            try:
                self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:  # a connected endpoint's peer is gone: the batch stays replayable
                logger.exception("kv events: batch %d could not be sent", seq)
            self.buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events: a replay request of %d frames, not [identity, b'', 8-byte seq]", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self.buffer):
            if seq >= first:
                self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))


class KVEventStream:
    """The engine's side: the allocator's events after each step, on the wire."""

    def __init__(self, allocator: KVAllocator, publisher: ZmqEventPublisher | None, medium: str) -> None:
        self.allocator, self.publisher, self.medium = allocator, publisher, medium

    @classmethod
    def create(cls, config: KVEventsConfig | None, allocator: KVAllocator, allocator_name: str, rank: int,
               device_type: str) -> KVEventStream:
        """The stream ``config`` asks for; one that publishes nothing when events are off
        (``publisher: null`` too) or the allocator cannot report them (said in the log)."""
        # NOTE: "GPU" names a CUDA device's memory, "CPU" host memory, as vLLM's media do.
        medium = "GPU" if device_type == "cuda" else "CPU"
        if config is None or not config.enable_kv_cache_events or config.publisher == "null":
            return cls(allocator, None, medium)
        if not allocator.reports_events:
            logger.warning("kv events: kv_allocator %s does not report KV cache events (its reports_events is "
                           "False): none are published", allocator_name)
            return cls(allocator, None, medium)
        allocator.enable_events()
        return cls(allocator, ZmqEventPublisher(config, rank), medium)

    def publish(self) -> None:
        """One batch of the events since the last call; none when there are none."""
        if self.publisher is None:
            return
        events = self.allocator.take_events()
        if events:
            bs = self.allocator.block_size
            self.publisher.publish([to_wire(e, bs, self.medium) for e in events])

    def close(self) -> None:
        if self.publisher is not None:
            self.publish()
            self.publisher.close()
            self.publisher = None
