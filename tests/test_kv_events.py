"""KV cache events (``kv_events_config``) as a prefix-aware router sees them: a plain pyzmq SUB
socket and msgspec structs of vLLM's current layout (its ``vllm/distributed/kv_events.py``)
decode the stream; the events rebuild the allocator's cached blocks; the replay socket resends;
each data-parallel rank publishes on its own port with its rank. docs/kv-events.md."""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import time
from array import array
from typing import Any, Optional, Union

import msgspec
import pytest
import zmq

from modserve.core.config import EngineConfig, KVEventsConfig
from modserve.core.contracts import kv_allocator as core
from modserve.engine.kv_events import KVEventStream, offset_endpoint_port
from modserve.plugins.kv_allocators.contiguous import ContiguousAllocator
from modserve.plugins.kv_allocators.paged import PagedAllocator
from modserve.plugins.kv_allocators.radix import RadixAllocator
from modserve.testing.conformance.kv_events import EventCheckedWorkload
from server_process import launch_healthy, stop

MODEL = "tiny"
BS = 4


# -- a subscriber as a user writes it from vLLM's event structs: the batch an array, events maps --
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODE = msgspec.msgpack.Decoder(type=KVEventBatch)


class Subscriber:
    """SUB on ``endpoint`` (topic-filtered); ``read`` gathers (seq, payload, batch) until quiet."""

    def __init__(self, context: zmq.Context, endpoint: str, topic: str = "") -> None:
        self.sock = context.socket(zmq.SUB)
        self.sock.connect(endpoint)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.got: list[tuple[int, bytes, KVEventBatch]] = []

    def read(self, quiet: float = 1.0) -> list[tuple[int, bytes, KVEventBatch]]:
        while self.sock.poll(int(quiet * 1000)):
            _, seq, payload = self.sock.recv_multipart()
            self.got.append((int.from_bytes(seq, "big"), payload, DECODE.decode(payload)))
        return self.got


def replay(context: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Every batch the replay socket resends from ``start`` on (a DEALER: a REQ reads one reply)."""
    sock = context.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    try:
        while sock.poll(5000):
            _, _topic, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            out.append((int.from_bytes(seq, "big"), payload))
        raise AssertionError("the replay did not end with its -1 marker")
    finally:
        sock.close(linger=0)


def rebuild(batches: list[KVEventBatch]) -> tuple[set[int], int]:
    """The cached block hashes the stream says are there, and how many removals it named."""
    cached: set[int] = set()
    removed = 0
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                cached.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= cached, "a BlockRemoved names a block never stored"
                cached.difference_update(event.block_hashes)
                removed += len(event.block_hashes)
            else:
                cached.clear()
    return cached, removed


def chain_hashes(tokens: list[int], parent: bytes = b"") -> list[int]:
    """The wire hashes of ``tokens``' full blocks, as docs/kv-events.md derives them: sha256 over
    the parent's digest and the block's tokens as int64s; the low 64 bits of each digest."""
    out = []
    for start in range(0, len(tokens) - len(tokens) % BS, BS):
        parent = hashlib.sha256(parent + array("q", tokens[start:start + BS]).tobytes()).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def two_free_ports() -> int:
    """A port p with p + 1 free too (data-parallel rank 1 publishes on p + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports")


def serve(tmp_path, llama_dir, name: str, events: dict, *flags: str):
    return launch_healthy(tmp_path, name, "--model", llama_dir, "--served-model-name", MODEL, "--num-threads", "1",
                          "--block-size", str(BS), "--max-model-len", "64", "--kv-events-config", json.dumps(events),
                          *flags, timeout=180)


def complete(server, prompt: list[int]) -> None:
    server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)


# -- against a real server ---------------------------------------------------------------------------
def test_a_subscriber_sees_stored_and_evicted_blocks_in_order_and_replays_them(tmp_path, llama_dir):
    pub, rep = two_free_ports(), two_free_ports()
    server = serve(tmp_path, llama_dir, "kv-events", {
        "enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{rep}",
        "topic": "kv-events"}, "--num-kv-blocks", "16")
    context = zmq.Context()
    try:
        sub = Subscriber(context, f"tcp://127.0.0.1:{pub}", "kv-events")
        time.sleep(1.0)  # the subscription reaches the publisher before the first event
        p1 = list(range(10, 23))  # 13 tokens: 3 full blocks
        complete(server, p1)
        first = [b for _, _, b in sub.read()]
        stored = [e for b in first for e in b.events]
        assert stored and all(isinstance(e, BlockStored) for e in stored), stored
        assert [h for e in stored for h in e.block_hashes] == chain_hashes(p1)
        assert stored[0].parent_block_hash is None and [t for e in stored for t in e.token_ids] == p1[:12]
        assert {(e.block_size, e.medium, e.lora_id, e.lora_name) for e in stored} == {(BS, "CPU", None, None)}
        assert {b.data_parallel_rank for b in first} == {0}

        p2 = p1[:8] + list(range(100, 105))  # shares P1's first 2 blocks: stores only its third
        complete(server, p2)
        (extra,) = [e for _, _, b in sub.read()[len(first):] for e in b.events]
        assert extra.parent_block_hash == chain_hashes(p1)[1] and extra.token_ids == p2[8:12]
        assert extra.block_hashes == chain_hashes(p2)[2:3]

        for i in range(6):  # 6 more prompts of 3 cached blocks each: more than 16 blocks hold
            complete(server, [200 + 20 * i + t for t in range(13)])
        got = sub.read()
        seqs = [s for s, _, _ in got]
        assert seqs == list(range(len(got))), f"sequence numbers not 0, 1, 2, ...: {seqs}"
        cached, removed = rebuild([b for _, _, b in got])
        evictions = server.metrics()["modserve_prefix_cache_evictions_total"]
        assert removed == evictions > 0, f"{removed} blocks removed on the stream, the allocator evicted {evictions}"
        assert len(cached) <= 16

        # A subscriber that joins now rebuilds the same set from the replay socket alone.
        assert replay(context, f"tcp://127.0.0.1:{rep}", 0) == [(s, p) for s, p, _ in got]
        middle = len(got) // 2
        assert [s for s, _ in replay(context, f"tcp://127.0.0.1:{rep}", middle)] == seqs[middle:]
        late, _ = rebuild([DECODE.decode(p) for _, p in replay(context, f"tcp://127.0.0.1:{rep}", 0)])
        assert late == cached
    finally:
        context.destroy(linger=0)
        stop(server)


def test_each_data_parallel_rank_publishes_on_its_own_port_with_its_rank(tmp_path, llama_dir):
    port = two_free_ports()
    server = serve(tmp_path, llama_dir, "kv-events-dp2", {"enable_kv_cache_events": True,
                                                          "endpoint": f"tcp://*:{port}"},
                   "--num-kv-blocks", "32", "-dp", "2", "--data-parallel-routing", "load")
    context = zmq.Context()
    try:
        subs = [Subscriber(context, f"tcp://127.0.0.1:{port + r}") for r in (0, 1)]
        time.sleep(1.0)
        # One request of two prompts: the load router routes each alone, the second to the rank the
        # first left idle.
        server.client().completions.create(model=MODEL, prompt=[list(range(30, 43)), list(range(50, 63))],
                                           max_tokens=3, temperature=0)
        for rank, sub in enumerate(subs):
            batches = [b for _, _, b in sub.read()]
            assert batches, f"nothing from rank {rank} on port {port + rank}"
            assert {b.data_parallel_rank for b in batches} == {rank}
    finally:
        context.destroy(linger=0)
        stop(server)


# -- in process -----------------------------------------------------------------------------------
def test_offline_llm_publishes_and_reset_prefix_cache_clears(llama_dir):
    from modserve.llm import LLM
    from modserve.sampling_params import SamplingParams

    port = two_free_ports()
    llm = LLM(model=llama_dir, num_kv_blocks=16, block_size=BS, max_model_len=64, num_threads=1,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    context = zmq.Context()
    try:
        sub = Subscriber(context, f"tcp://127.0.0.1:{port}")
        time.sleep(1.0)
        llm.generate([list(range(10, 23))], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        llm.reset_prefix_cache()
        events = [e for _, _, b in sub.read() for e in b.events]
        assert isinstance(events[0], BlockStored) and isinstance(events[-1], AllBlocksCleared), events
        assert rebuild([b for _, _, b in sub.got]) == (set(), 0)
    finally:
        context.destroy(linger=0)
        llm.engine.shutdown()


class TruthCheckedWorkload(EventCheckedWorkload):
    """The conformance kit's event checks, and after each operation the keys the events rebuild
    are exactly those the allocator's prefix cache holds."""

    def __init__(self, alloc, seed: int, truth) -> None:
        super().__init__(alloc, seed)
        self.truth = truth

    def check(self, when: str) -> None:
        super().check(when)
        assert self.cached_keys() == self.truth(self.alloc), f"after {when}: the events rebuild other keys"


def paged_keys(alloc: PagedAllocator) -> set[str]:
    return set(alloc.cached)


def radix_keys(alloc: RadixAllocator) -> set[str]:
    """The tree's blocks, each keyed by the tokens from the root to its end."""
    keys, stack = set(), [(child, ()) for child in alloc.root.children.values()]
    while stack:
        node, above = stack.pop()
        tokens = above + node.tokens
        keys.update(core.block_keys(list(tokens), alloc.block_size)[-len(node.blocks):])
        stack.extend((child, tokens) for child in node.children.values())
    return keys


@pytest.mark.parametrize("make, truth", [(PagedAllocator, paged_keys), (RadixAllocator, radix_keys)],
                         ids=["paged", "radix"])
def test_allocator_events_rebuild_its_prefix_cache(make, truth):
    counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
    for seed in range(4):
        alloc = make(24, BS, 48)
        work = TruthCheckedWorkload(alloc, seed, truth)
        work.run(400)
        for kind in counts:
            counts[kind] += work.counts[kind]
    assert all(counts.values()), f"the workload did not exercise every event: {counts}"


def test_an_allocator_that_cannot_report_events_is_named_and_publishes_nothing(caplog):
    alloc = ContiguousAllocator(8, BS, 32)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://never")
    with caplog.at_level(logging.WARNING, logger="modserve"):
        stream = KVEventStream.create(config, alloc, "contiguous", 0, "cpu")
    assert stream.publisher is None and "kv_allocator contiguous does not report KV cache events" in caplog.text
    # publisher "null" disables, as vLLM's
    paged = PagedAllocator(8, BS, 32)
    stream = KVEventStream.create(KVEventsConfig(enable_kv_cache_events=True, publisher="null"), paged, "paged", 0,
                                  "cpu")
    assert stream.publisher is None and paged.events is None


def test_endpoints_offset_by_rank_as_vllm_and_the_config_refuses_unknown_keys(llama_dir):
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://*:0", 3) == "tcp://*:0"
    assert offset_endpoint_port("inproc://cache", 1) == "inproc://cache_dp1"
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert KVEventsConfig().publisher == "null"
    with pytest.raises(ValueError, match="kv_events_config.enable_kv_cache_event\n"):
        EngineConfig(model=llama_dir, kv_events_config={"enable_kv_cache_event": True})
