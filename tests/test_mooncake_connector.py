"""``kv_connector: mooncake``: a producer server and a consumer engine in two processes,
the prompt blocks pulled over TCP by Mooncake's transfer engine on 127.0.0.1.

The consumer's greedy tokens are one engine's while it loads every whole prompt block but
the last token's (computing none of them); the producer frees the blocks it held once the
consumer has read them, and those of a prompt no consumer reads after its timeout. A block
freed by that timeout and reused while a consumer reads it fails its load.
"""

from __future__ import annotations

import json
import random
import uuid

import pytest
import torch
from server_process import free_port, launch_healthy, stop, wait_for

from modserve import LLM, SamplingParams
from modserve.api import AttentionSpec, BlockTransfer, KVConnectorContext
from modserve.plugins.kv_connectors.mooncake import MooncakeConnector, MooncakeOptions

try:
    from mooncake.engine import TransferEngine  # noqa: F401
except ImportError as e:  # the wheel is not installed, or libibverbs.so.1 is missing
    pytest.skip(f"Mooncake's transfer engine does not import here: {e}", allow_module_level=True)

BLOCK = 16
LENGTHS = (40, 77, 100, 5)  # full blocks 2, 4, 6, 0: none ends on the last token, so all are read
TIMEOUT_S = 8.0  # the producer's abort_request_timeout: long enough for the consumer to come
ENGINE = dict(dtype="float32", progress=False, num_kv_blocks=64, max_model_len=256, block_size=BLOCK)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
HELD = "modserve_kv_connector_blocks_held"
EXPIRED = "modserve_kv_connector_blocks_held_expired_total"


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4000) for _ in range(n)] for n in LENGTHS]


def generate(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(ps, GREEDY, use_tqdm=False)]


def prefill(server, ps: list[list[int]]) -> None:
    """What a router sends the producer first: each prompt, for one token."""
    server.client().completions.create(model="tiny", prompt=ps, max_tokens=1, temperature=0.0)


def test_consumer_pulls_blocks_over_tcp_and_producer_frees_them(llama_dir, tmp_path):
    port = free_port()
    config = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",  # vLLM's spelling, mapped
              "kv_connector_extra_config": {"bootstrap_port": port, "abort_request_timeout": TIMEOUT_S}}
    producer = launch_healthy(tmp_path, "producer", "--model", llama_dir, "--served-model-name", "tiny",
                              "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256",
                              "--num-threads", "1", "--kv-transfer-config", json.dumps(config))
    consumer = None
    try:
        consumer = LLM(llama_dir, kv_role="consumer", **ENGINE, kv_connector={
            "name": "mooncake", "options": {"remote_bootstrap_addr": f"127.0.0.1:{port}"}})
        ps = prompts(0)
        prefill(producer, ps)
        held = producer.metrics()
        assert held[HELD] == sum(n // BLOCK for n in LENGTHS)
        got = generate(consumer, ps)

        stats = consumer.engine.stats()
        usable = sum((n - 1) // BLOCK for n in LENGTHS)
        # What it computed: each prompt's tokens past its read blocks, then the decode steps.
        decode = len(LENGTHS) * (GREEDY.max_tokens - 1)
        assert stats["computed_tokens"] == sum(n - (n - 1) // BLOCK * BLOCK for n in LENGTHS) + decode
        # The consumer computed no block it was sent: it read every one, and all came whole.
        assert stats["kv_connector_blocks_loaded"] == stats["kv_connector_blocks_read"] == usable > 0
        assert stats["kv_connector_blocks_load_failed"] == stats["kv_connector_blocks_stale"] == 0
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        after = producer.metrics()
        assert after[HELD] == 0, "the producer still holds blocks the consumer has read"
        assert after["modserve_kv_blocks_free"] == after["modserve_kv_blocks_total"]

        # A consumer that never comes: the producer frees what it held once the timeout passes.
        prefill(producer, prompts(1)[:2])
        assert producer.metrics()[HELD] == sum(n // BLOCK for n in LENGTHS[:2])
        wait_for(lambda: producer.metrics()[HELD] == 0, timeout=TIMEOUT_S + 10)
        assert producer.metrics()[EXPIRED] == sum(n // BLOCK for n in LENGTHS[:2])
    finally:
        if consumer is not None:
            consumer.engine.shutdown()
        stop(producer)

    llm = LLM(llama_dir, **ENGINE)
    want = generate(llm, ps)
    llm.engine.shutdown()
    assert got == want


def own_pool(num_blocks: int) -> tuple[MooncakeConnector, torch.Tensor]:
    """A connector of role both, which reads its own pool over TCP, on a one-layer cache."""
    spec = AttentionSpec(num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8, scale=1.0, block_size=4,
                         dtype=torch.float32, device=torch.device("cpu"), kv_cache_dtype=torch.float32)
    conn = MooncakeConnector(KVConnectorContext("both", spec, range(1), "kit"),
                             MooncakeOptions(bootstrap_port=0, num_blocks=num_blocks))
    cache = torch.randn(2, 6, 4, 2, 8)  # [K/V, blocks, block_size, kv_heads, head_dim]
    conn.register_kv_caches([cache])
    return conn, cache


def test_a_block_freed_and_reused_during_a_read_fails_its_load():
    """The producer's timeout frees a slot and a new block takes it between the consumer's
    lookup and its read: the consumer reads the new block's bytes, and must not use them."""
    conn, cache = own_pool(2)
    try:
        old, new, kept = (uuid.uuid4().hex * 2 for _ in range(3))
        for key, block in ((old, 0), (kept, 1)):
            conn.save_layer(0, cache, [BlockTransfer(key, block)])
            conn.finish_saves()
        assert conn.stored_blocks([old, kept]) == 2  # the consumer's lookup: where both are
        conn.held[old].deadline = 0.0
        conn._expire()  # as the side channel's thread would, past abort_request_timeout
        conn.save_layer(0, cache, [BlockTransfer(new, 2)])  # takes the slot the old block had
        conn.finish_saves()
        assert conn.load([BlockTransfer(old, 3), BlockTransfer(kept, 4)]) == [0]
        assert torch.equal(cache[:, 4], cache[:, 1])  # the one still held came whole
        assert conn.stats()["blocks_stale"] == 1
        assert conn.stats()["blocks_held"] == 1  # the new block; the read chain was released
    finally:
        conn.close()


def test_a_read_the_transport_refuses_fails_that_block_alone():
    """A batched read with one bad address fails as a whole: the others are read again alone."""
    conn, cache = own_pool(3)
    try:
        keys = [uuid.uuid4().hex * 2 for _ in range(3)]
        for i, key in enumerate(keys):
            conn.save_layer(0, cache, [BlockTransfer(key, i)])
        conn.finish_saves()
        assert conn.stored_blocks(keys) == 3
        found = conn.found[keys[1]]
        conn.found[keys[1]] = found._replace(addr=found.addr + 2**40)  # outside the producer's registered pool
        assert conn.load([BlockTransfer(k, 3 + i) for i, k in enumerate(keys)]) == [1]
        assert torch.equal(cache[:, 3], cache[:, 0]) and torch.equal(cache[:, 5], cache[:, 2])
        assert conn.stats()["blocks_held"] == 0  # the chain was released, the failed block too
    finally:
        conn.close()
