"""Which prefill server holds how much of a prompt: an index of each server's cached blocks,
kept from its KV cache events (docs/kv-events.md), as llm-d's precise prefix-cache scorer and
Dynamo's KV router keep theirs.

Each event stream (one per engine: a data-parallel server has one per rank) is followed by a
plain ZMQ SUB socket on the router's event loop: ``BlockStored`` adds hashes, ``BlockRemoved``
takes them away, ``AllBlocksCleared`` empties the stream's set. A gap in the sequence numbers
is filled from the stream's replay socket when it has one; what cannot be filled empties the
set, which then grows again from the events that follow. Either way the set only ever holds
blocks the engine holds (or held until an event not yet read): a stale index can cost a prefix
hit, never send a prompt where its blocks were evicted long ago.

A prompt's blocks are hashed by ``block_keys``, the function the engines' allocators key their
prefix cache by, with each stream's block size and, for a LoRA adapter, the salt that stream's
engine keys it by (its ``lora_id`` learnt from the stream's own ``BlockStored`` events).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import msgspec
import zmq
import zmq.asyncio

from modserve.core.contracts.kv_allocator import block_keys
from modserve.core.lora_request import LoRARequest
from modserve.engine.kv_events import (END_OF_REPLAY, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                       block_hash)
from modserve.server.router_upstreams import Upstream

logger = logging.getLogger("modserve.router")

REPLAY_TIMEOUT_S = 2.0  # a replay socket silent this long is given up on: the stream's set is emptied instead


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one engine of an upstream publishes (its ``kv_events_config`` endpoints, as reached
    from the router)."""

    upstream: Upstream
    endpoint: str
    replay_endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class PrefixRouting:
    """``modserve router``'s prefix-aware routing of prefill requests: the event streams
    (``(prefill url, endpoint, replay endpoint or None)``), the tokenizer and chat template the
    servers use, and how much busier than the least loaded a server may be and still win on its
    prefix (docs/disaggregation.md)."""

    sources: tuple[tuple[str, str, str | None], ...]
    tokenizer: str
    chat_template: str | None = None
    balance_slack: int = 4  # router_cli's PREFIX_BALANCE_SLACK


@dataclass(slots=True)
class StreamState:
    """What one event stream says its engine holds."""

    source: EventSource
    blocks: set[int] = field(default_factory=set)  # wire hashes of the cached blocks
    block_size: int | None = None  # from its BlockStored events; None: nothing stored yet
    loras: dict[str, int] = field(default_factory=dict)  # adapter name -> the engine's lora_id
    expected: int | None = None  # the next sequence number; None: no batch read yet
    replayed: range = range(0)  # sequence numbers a replay already applied (the live copies are skipped)

    def apply(self, batch: KVEventBatch) -> tuple[int, int]:
        """(blocks stored, blocks removed) by ``batch``'s events."""
        stored = removed = 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.blocks.update(event.block_hashes)
                self.block_size = event.block_size
                if event.lora_name is not None and event.lora_id is not None:
                    self.loras[event.lora_name] = event.lora_id
                stored += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.blocks.difference_update(event.block_hashes)
                removed += len(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()
        return stored, removed

    def reset(self) -> None:
        self.blocks.clear()


class IndexObserver(Protocol):
    """Told what the index does as it follows the streams (the router's metrics)."""

    def kv_batch(self, upstream: Upstream, indexed: int, stored: int, removed: int) -> None:
        """A batch applied: the upstream's blocks in the index now, the blocks it stored and removed."""

    def kv_gap(self, upstream: Upstream, outcome: str) -> None:
        """Missed batches: ``replayed``, or ``reset`` (the stream's blocks forgotten)."""


class PrefixIndex:
    """The cached blocks of every upstream with event streams; loop thread only."""

    def __init__(self, sources: Sequence[EventSource], observer: IndexObserver | None = None) -> None:
        self.streams = [StreamState(s) for s in sources]
        self.observer = observer
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.context: zmq.asyncio.Context | None = None
        self.tasks: list[asyncio.Task] = []

    # -- scoring ---------------------------------------------------------------------------------
    def matched(self, upstream: Upstream, prompts: Sequence[Sequence[int]], model: str | None) -> int:
        """Leading blocks of ``prompts`` (summed over them) that ``upstream`` holds, by the stream of
        its that holds the most; 0 for an upstream without streams."""
        adapters = {name for s in self.streams for name in s.loras}
        best = 0
        for s in self.streams:
            if s.source.upstream != upstream or s.block_size is None or not s.blocks:
                continue
            if model in s.loras:
                salt = LoRARequest(model, s.loras[model], lora_path="(router)").cache_salt
            elif model in adapters:  # an adapter this engine never cached a block of
                continue
            else:  # the base model (or an adapter no engine has cached yet: none holds its blocks)
                salt = b""
            best = max(best, sum(self.leading(s, ids, salt) for ids in prompts))
        return best

    @staticmethod
    def leading(stream: StreamState, token_ids: Sequence[int], salt: bytes) -> int:
        """How many of the prompt's first blocks the stream holds; hashed only as far as it matches."""
        keys: list[str] = []  # block_keys extends it in place, one block a turn
        n = 0
        while True:
            block_keys(token_ids, stream.block_size, n + 1, keys, salt)
            if len(keys) <= n or block_hash(keys[n]) not in stream.blocks:
                return n
            n += 1

    def indexed(self, upstream: Upstream) -> int:
        return sum(len(s.blocks) for s in self.streams if s.source.upstream == upstream)

    # -- following the streams -------------------------------------------------------------------
    def start(self) -> None:
        """One task per stream on the running loop."""
        self.context = zmq.asyncio.Context()
        self.tasks = [asyncio.create_task(self.follow(s), name=f"kv-events {s.source.endpoint}")
                      for s in self.streams]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []
        if self.context is not None:
            self.context.destroy(linger=0)
            self.context = None

    async def follow(self, stream: StreamState) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: an endpoint is one engine's
        sub.connect(stream.source.endpoint)
        logger.info("kv events: following %s for the %s server at %s", stream.source.endpoint,
                    stream.source.upstream.role, stream.source.upstream.url)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    logger.warning("kv events from %s: a message of %d frames, not (topic, seq, payload)",
                                   stream.source.endpoint, len(frames))
                    continue
                try:
                    await self.receive(stream, int.from_bytes(frames[1], "big"), frames[2])
                except zmq.ZMQError:  # the replay socket's: the stream starts afresh from the next batch
                    logger.exception("kv events from %s: replay failed; its blocks are forgotten",
                                     stream.source.endpoint)
                    stream.reset()
                    stream.expected = None
        finally:
            sub.close(linger=0)

    async def receive(self, stream: StreamState, seq: int, payload: bytes) -> None:
        if seq in stream.replayed:  # the live copy of a batch the replay applied
            if seq == stream.replayed[-1]:
                stream.replayed = range(0)
            return
        if stream.expected is not None and seq < stream.expected:
            # The numbers start again: a restarted engine, whose cache is empty.
            logger.info("kv events from %s: sequence %d after %d, the engine restarted", stream.source.endpoint,
                        seq, stream.expected - 1)
            stream.reset()
            self.gap(stream, "reset")
        elif stream.expected is not None and seq > stream.expected:
            self.gap(stream, await self.catch_up(stream, seq))
            if seq < stream.expected:  # the replay had it
                return
        self.take(stream, seq, payload)

    def take(self, stream: StreamState, seq: int, payload: bytes) -> None:
        stored = removed = 0
        try:
            batch = self.decoder.decode(payload)
        except msgspec.DecodeError as e:  # an event this router does not know: its blocks are unknown now
            logger.warning("kv events from %s: batch %d not decoded (%s); its blocks are forgotten",
                           stream.source.endpoint, seq, e)
            stream.reset()
        else:
            stored, removed = stream.apply(batch)
        stream.expected = seq + 1
        if self.observer is not None:
            upstream = stream.source.upstream
            self.observer.kv_batch(upstream, self.indexed(upstream), stored, removed)

    def gap(self, stream: StreamState, outcome: str) -> None:
        if self.observer is not None:
            self.observer.kv_gap(stream.source.upstream, outcome)

    async def catch_up(self, stream: StreamState, seq: int) -> str:
        """Batches ``stream.expected`` up to ``seq`` were missed: replayed when the replay socket
        has them all, else the stream's set is emptied (and what was replayed applied after)."""
        missed = stream.expected
        replayed = await self.replay(stream, missed) if stream.source.replay_endpoint else []
        whole = bool(replayed) and replayed[0][0] == missed
        if not whole:
            stream.reset()
        for s, payload in replayed:
            if s >= stream.expected:
                self.take(stream, s, payload)
        if replayed:
            stream.replayed = range(replayed[0][0], replayed[-1][0] + 1)
        if not whole:
            stream.expected = max(stream.expected, seq)  # the live batch ``seq`` comes next
        outcome = "replayed" if whole else "reset"
        logger.info("kv events from %s: batches %d to %d missed: %s", stream.source.endpoint, missed, seq - 1, outcome)
        return outcome

    async def replay(self, stream: StreamState, start: int) -> list[tuple[int, bytes]]:
        """Every batch the replay socket still buffers from ``start`` on; [] if it does not answer
        within REPLAY_TIMEOUT_S."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(stream.source.replay_endpoint)
        got: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not await dealer.poll(REPLAY_TIMEOUT_S * 1e3):
                    logger.warning("kv events: the replay socket %s did not answer within %g s",
                                   stream.source.replay_endpoint, REPLAY_TIMEOUT_S)
                    return []
                frames = await dealer.recv_multipart()  # [b"", topic, seq, payload]
                if len(frames) != 4 or frames[2] == END_OF_REPLAY:
                    return got
                got.append((int.from_bytes(frames[2], "big"), frames[3]))
        finally:
            dealer.close(linger=0)
