"""The router's prefix index (router_prefix) in-process: batches from a real ZmqEventPublisher,
gaps filled from its replay socket or reset, an engine restart, LoRA adapters' blocks apart, and
the routing rule that mixes prefix and load (router_balance). The end-to-end check, two real
prefill servers behind a real router, is tests/test_router.py's."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from modserve.core.config import KVEventsConfig
from modserve.core.contracts.kv_allocator import block_keys
from modserve.core.lora_request import LoRARequest
from modserve.engine.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher,
                                       block_hash)
from modserve.server.router_balance import Balancer
from modserve.server.router_prefix import EventSource, PrefixIndex
from modserve.server.router_upstreams import Upstream

BS = 4
A, B = Upstream("prefill", "http://a:1"), Upstream("prefill", "http://b:1")
PROMPT = list(range(100, 120))  # 5 blocks
OTHER = list(range(500, 512))  # 3 blocks


def hashes(tokens: list[int], salt: bytes = b"") -> list[int]:
    return [block_hash(k) for k in block_keys(tokens, BS, salt=salt)]


def stored(tokens: list[int], lora: LoRARequest | None = None) -> BlockStored:
    salt = b"" if lora is None else lora.cache_salt
    return BlockStored(hashes(tokens, salt), None, tokens, BS, lora and lora.lora_int_id, "CPU",
                       lora and lora.lora_name)


def payload(*events) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(time.time(), list(events), 0))


class Seen:
    """An IndexObserver that keeps what it was told."""

    def __init__(self) -> None:
        self.gaps: list[str] = []
        self.removed = 0

    def kv_batch(self, upstream: Upstream, indexed: int, stored: int, removed: int) -> None:
        self.removed += removed

    def kv_gap(self, upstream: Upstream, outcome: str) -> None:
        self.gaps.append(outcome)


@pytest.fixture
def publisher():
    """A real publisher (the engine's) with a replay socket, on ports the system picks."""
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0",
                                           replay_endpoint="tcp://*:0"), rank=0)
    yield pub
    pub.close()


def local(sock: zmq.Socket) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT).replace("0.0.0.0", "127.0.0.1")


def test_a_gap_is_replayed_or_else_the_stream_is_reset(publisher):
    """Batches 1 and 2 missed: replayed from the publisher's buffer the index equals one that saw
    every batch; with no replay socket it holds only what came after the gap."""
    for events in ([stored(PROMPT[:12])], [BlockStored(hashes(PROMPT)[3:], hashes(PROMPT)[2], PROMPT[12:], BS, None,
                                                       "CPU", None)],
                   [BlockRemoved(hashes(PROMPT)[4:], "CPU")], [stored(OTHER)]):
        publisher.publish(events)
    deadline = time.monotonic() + 10
    while len(publisher.buffer) < 4:
        assert time.monotonic() < deadline, "the publisher did not send its batches"
        time.sleep(0.01)
    batches = dict(publisher.buffer)

    async def follow(replay: str | None, duplicate: bool) -> tuple[PrefixIndex, Seen]:
        seen = Seen()
        index = PrefixIndex([EventSource(A, "tcp://127.0.0.1:1", replay)], seen)
        index.context = zmq.asyncio.Context()
        try:
            stream = index.streams[0]
            await index.receive(stream, 0, batches[0])
            await index.receive(stream, 3, batches[3])  # 1 and 2 never came
            if duplicate:
                await index.receive(stream, 3, batches[3])  # the live copy of a replayed batch: skipped
        finally:
            index.context.destroy(linger=0)
        return index, seen

    replayed, seen = asyncio.run(follow(local(publisher.replay), True))
    assert replayed.streams[0].blocks == set(hashes(PROMPT)[:4] + hashes(OTHER))
    assert seen.gaps == ["replayed"] and seen.removed == 1
    assert replayed.matched(A, [PROMPT], None) == 4 and replayed.matched(A, [OTHER + PROMPT], None) == 3
    assert replayed.streams[0].expected == 4

    reset, seen = asyncio.run(follow(None, False))
    assert reset.streams[0].blocks == set(hashes(OTHER)) and seen.gaps == ["reset"]
    assert reset.matched(A, [PROMPT], None) == 0


def test_the_index_follows_a_live_stream_and_a_restart_empties_it(publisher):
    async def run() -> None:
        seen = Seen()
        index = PrefixIndex([EventSource(A, local(publisher.pub), local(publisher.replay))], seen)
        index.start()
        try:
            # a SUB socket joins a while after it connects: publish until the index has heard
            deadline = time.monotonic() + 10
            while not index.streams[0].blocks:
                assert time.monotonic() < deadline, "no batch reached the index"
                publisher.publish([stored(PROMPT)])
                await asyncio.sleep(0.05)
            publisher.publish([BlockRemoved(hashes(PROMPT)[2:], "CPU"), stored(OTHER)])
            while index.streams[0].blocks != set(hashes(PROMPT)[:2] + hashes(OTHER)):
                assert time.monotonic() < deadline, index.streams[0].blocks
                await asyncio.sleep(0.01)
            assert index.matched(A, [PROMPT, OTHER], None) == 2 + 3 and index.matched(B, [PROMPT], None) == 0
            publisher.publish([AllBlocksCleared()])
            while index.streams[0].blocks:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            # a restarted engine numbers its batches from 0 again: whatever the index held is gone
            stream = index.streams[0]
            stream.blocks.update(hashes(OTHER))
            await index.receive(stream, 0, payload(stored(PROMPT[:8])))
            assert stream.blocks == set(hashes(PROMPT)[:2]) and seen.gaps == ["reset"]
        finally:
            await index.stop()

    asyncio.run(run())


def test_an_adapters_blocks_match_only_its_requests():
    """The engine keys an adapter's blocks from its salt (its lora_id and name, learnt from the
    stream's BlockStored): a base-model request does not match them, nor another adapter's."""
    sql, chat = LoRARequest("sql", 3, "/x"), LoRARequest("chat", 1, "/y")
    index = PrefixIndex([EventSource(A, "tcp://127.0.0.1:1"), EventSource(B, "tcp://127.0.0.1:2")])

    async def feed() -> None:
        await index.receive(index.streams[0], 0, payload(stored(PROMPT, sql)))
        await index.receive(index.streams[1], 0, payload(stored(PROMPT), stored(OTHER, chat)))

    asyncio.run(feed())
    assert [index.matched(u, [PROMPT], "sql") for u in (A, B)] == [5, 0]
    assert [index.matched(u, [PROMPT], "base") for u in (A, B)] == [0, 5]
    assert [index.matched(u, [PROMPT], None) for u in (A, B)] == [0, 5]
    assert [index.matched(u, [OTHER], "chat") for u in (A, B)] == [0, 3]


def test_the_longest_prefix_wins_within_the_balance_slack():
    gauge: dict[str, int] = {}
    c = Upstream("prefill", "http://c:1")
    pool = Balancer([A, B, c], lambda u, n: gauge.__setitem__(u.url, n))
    usable = [True, True, True]
    assert pool.acquire_prefix(usable, [0, 3, 1], slack=2) == (B, "prefix")
    assert pool.acquire_prefix(usable, [0, 3, 1], slack=2) == (B, "prefix")  # 1 busier than A: within the slack
    assert pool.acquire_prefix(usable, [0, 3, 1], slack=2) == (c, "prefix")  # B 2 busier: the next longest
    assert pool.acquire_prefix(usable, [0, 3, 0], slack=2) == (A, "load")  # only B holds any: by load
    assert pool.acquire_prefix([True, False, True], [2, 3, 2], slack=2) == (c, "prefix")  # tied: in turn after A
    assert pool.acquire_prefix(usable, [2, 0, 2], slack=2) == (A, "prefix")  # tied: the less busy
    assert pool.acquire_prefix([False, False, False], [1, 1, 1], slack=2) == (None, "load")
    assert pool.outstanding == [2, 2, 2] and gauge == {A.url: 2, B.url: 2, c.url: 2}
