"""vLLM's ``kv_transfer_params`` drive a modserve pair: a proxy written here, as vLLM's toy
disaggregation proxy does it, sends the prefill server ``{"do_remote_decode": true}``, puts
the ``kv_transfer_params`` of its answer into the decode request, and the decode server's
``kv_connector: mooncake`` (configured with no producer at all) pulls the prompt's blocks from
the producer those params name; ``modserve router`` in front of the pair does the same. Malformed
params are a 400 naming the field.
"""

from __future__ import annotations

import json
import random

import uuid

import httpx
import pytest
import torch
from server_process import free_port, launch, stop, wait_healthy
from test_router import launch_router, wait_listening

from modserve import LLM, SamplingParams
from modserve.api import AttentionSpec, BlockTransfer, KVConnectorContext
from modserve.plugins.kv_connectors import mooncake_channel
from modserve.plugins.kv_connectors.mooncake import MooncakeConnector, MooncakeOptions

try:
    from mooncake.engine import TransferEngine  # noqa: F401
except ImportError as e:  # the wheel is not installed, or libibverbs.so.1 is missing
    pytest.skip(f"Mooncake's transfer engine does not import here: {e}", allow_module_level=True)

BLOCK = 16
LENGTHS = (40, 77, 100)
MAX_TOKENS = 8
READ = "modserve_kv_connector_blocks_read_total"
FLAGS = ("--served-model-name", "tiny", "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256",
         "--num-threads", "1")


def mooncake(role: str, **options) -> tuple[str, str]:
    return "--kv-transfer-config", json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                                               "kv_connector_extra_config": options})


def proxy(prefill: str, decode: str, route: str, body: dict) -> dict:
    """vLLM's toy proxy: the prefill half for one token, then the decode half with its params."""
    first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}}
    r = httpx.post(f"{prefill}{route}", json=first, timeout=60)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    r = httpx.post(f"{decode}{route}", json={**body, "kv_transfer_params": params}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def refused(url: str, route: str, body: dict) -> str:
    r = httpx.post(f"{url}{route}", json=body, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text)
    return r.json()["error"]["message"]


def test_a_vllm_style_proxy_drives_a_modserve_pair(llama_dir, tmp_path):
    rng = random.Random(7)
    ps = [[rng.randrange(3, 4000) for _ in range(n)] for n in LENGTHS]
    port = free_port()
    producer = launch(tmp_path, "producer", "--model", llama_dir, *FLAGS, *mooncake("kv_producer", bootstrap_port=port))
    # No prefix cache: a prompt it served before is read again, not found in its own cache. It
    # names no producer, so the two starts overlap.
    consumer = launch(tmp_path, "consumer", "--model", llama_dir, *FLAGS, "--no-enable-prefix-caching",
                      *mooncake("kv_consumer"))
    router = None
    try:
        wait_healthy(producer)
        wait_healthy(consumer)
        greedy = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        texts = []
        for p in ps:
            before = consumer.metrics()[READ]
            out = proxy(producer.url, consumer.url, "/v1/completions", {**greedy, "prompt": p})
            texts.append(out["choices"][0]["text"])
            assert "kv_transfer_params" not in out  # a decode answer carries none
            # The decode server read every whole block but the last token's from the producer named.
            assert consumer.metrics()[READ] - before == (len(p) - 1) // BLOCK
        assert producer.metrics()["modserve_kv_connector_blocks_held"] == 0

        # `modserve router` does what the proxy does: the same reads, the same tokens, streamed too.
        router = launch_router(tmp_path, "router", producer.url, consumer.url)
        wait_listening(router)
        for p, text in zip(ps, texts):
            before = consumer.metrics()[READ]
            streamed = {**greedy, "prompt": p, "stream": True} if p is ps[-1] else {**greedy, "prompt": p}
            with httpx.stream("POST", f"{router.url}/v1/completions", json=streamed, timeout=60) as r:
                assert r.status_code == 200, r.read()
                body = r.read().decode()
            if "stream" in streamed:
                events = [json.loads(line.removeprefix("data: ")) for line in body.splitlines()
                          if line.startswith("data: {")]
                assert body.endswith("data: [DONE]\n\n") and all("error" not in e for e in events), body
                assert "".join(e["choices"][0]["text"] for e in events) == text
            else:
                assert json.loads(body)["choices"][0]["text"] == text
            assert consumer.metrics()[READ] - before == (len(p) - 1) // BLOCK
        assert producer.metrics()["modserve_kv_connector_blocks_held"] == 0

        # The prefill answer names this producer in vLLM's Mooncake and NIXL spellings.
        r = httpx.post(f"{producer.url}/v1/completions", timeout=60, json={
            **greedy, "prompt": ps[0], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        params = r.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_bootstrap_addr"] == f"127.0.0.1:{port}"
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", port)
        assert params["remote_request_id"] == r.json()["id"]
        assert producer.metrics()["modserve_kv_connector_blocks_held"] == len(ps[0]) // BLOCK
        # Without params the decode server computes the prompt: it has no producer of its own.
        before = consumer.metrics()[READ]
        r = httpx.post(f"{consumer.url}/v1/completions", json={**greedy, "prompt": ps[0]}, timeout=60)
        assert r.json()["choices"][0]["text"] == texts[0]
        assert consumer.metrics()[READ] == before
        # The blocks the prefill above holds, read by a decode naming the producer NIXL's way.
        nixl = {k: params[k] for k in ("do_remote_prefill", "remote_host", "remote_port", "remote_engine_id")}
        r = httpx.post(f"{consumer.url}/v1/completions", timeout=60,
                       json={**greedy, "prompt": ps[0], "kv_transfer_params": {**nixl, "remote_block_ids": [0, 1]}})
        assert r.json()["choices"][0]["text"] == texts[0]
        assert consumer.metrics()[READ] - before == (len(ps[0]) - 1) // BLOCK

        # Chat, through the same proxy.
        chat = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 6}]}
        before = consumer.metrics()[READ]
        got = proxy(producer.url, consumer.url, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
        assert consumer.metrics()[READ] > before
        alone = httpx.post(f"{producer.url}/v1/chat/completions", json=chat, timeout=60).json()
        assert got == alone["choices"][0]["message"]["content"]

        # Malformed or misplaced params: a 400 naming what is wrong.
        body = {**greedy, "prompt": ps[0]}
        for params, where in (({"do_remote_prefill": True}, "kv_transfer_params.do_remote_prefill"),
                              ({"do_remote_decode": True, "do_remote_prefill": True, "remote_port": 1,
                                "remote_host": "h"}, "kv_transfer_params.do_remote_prefill"),
                              ({"bootstrap": 1}, "kv_transfer_params.bootstrap"),
                              ({"remote_port": 70000}, "kv_transfer_params.remote_port"),
                              ({"remote_bootstrap_addr": "a b:1"}, "kv_transfer_params.remote_bootstrap_addr"),
                              ({"remote_bootstrap_addr": "h:65536"}, "kv_transfer_params.remote_bootstrap_addr"),
                              ({"remote_block_ids": "0,1"}, "kv_transfer_params.remote_block_ids"),
                              ("yes", "kv_transfer_params")):
            assert where in refused(consumer.url, "/v1/completions", {**body, "kv_transfer_params": params}), params
        message = refused(consumer.url, "/v1/completions", {**body, "kv_transfer_params": {"do_remote_decode": True}})
        assert message.startswith("kv_transfer_params.do_remote_decode: this server has no KV connector that saves")
        message = refused(producer.url, "/v1/completions", {**body, "kv_transfer_params": nixl})
        assert message.startswith("kv_transfer_params.do_remote_prefill: this server has no KV connector that loads")
        message = refused(producer.url, "/v1/completions", {**body, "stream": True,
                                                            "kv_transfer_params": {"do_remote_decode": True}})
        assert message.startswith("kv_transfer_params.do_remote_decode: needs stream false")

        for server in (producer, consumer):
            m = server.metrics()
            assert m["modserve_kv_blocks_free"] == m["modserve_kv_blocks_total"]
    finally:
        codes = [stop(s) if s is not None else 0 for s in (router, consumer, producer)]  # all, whatever happened
    assert codes[0] in (0, -15) and codes[1:] == [0, 0], codes  # uvicorn may end the router by the signal itself

    llm = LLM(llama_dir, dtype="float32", progress=False, num_kv_blocks=64, max_model_len=256, block_size=BLOCK)
    try:
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert texts == [o.outputs[0].text for o in outs]


def test_a_consumer_with_no_producer_reads_from_the_one_each_request_names(monkeypatch):
    """Connectors alone: the producer's transfer_params, read back by a consumer configured
    with none; a request naming no producer, or one that does not answer, loads nothing."""
    spec = AttentionSpec(num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8, scale=1.0, block_size=4,
                         dtype=torch.float32, device=torch.device("cpu"), kv_cache_dtype=torch.float32)
    producer = MooncakeConnector(KVConnectorContext("producer", spec, range(1), "kit"),
                                 MooncakeOptions(bootstrap_port=0, num_blocks=4))
    consumer = MooncakeConnector(KVConnectorContext("consumer", spec, range(1), "kit"),
                                 MooncakeOptions(max_remote_producers=1))
    try:
        source, cache = torch.randn(2, 4, 4, 2, 8), torch.zeros(2, 4, 4, 2, 8)  # [K/V, blocks, 4, heads, dim]
        producer.register_kv_caches([source])
        consumer.register_kv_caches([cache])
        keys = [uuid.uuid4().hex * 2 for _ in range(3)]
        producer.save_layer(0, source, [BlockTransfer(k, i) for i, k in enumerate(keys)])
        producer.finish_saves()
        remote = producer.transfer_params()
        assert consumer.transfer_params() is None
        assert consumer.stored_blocks(keys) == 0  # no producer of its own
        assert consumer.stored_blocks_from(keys, {"do_remote_prefill": True}) == 0  # none named
        elsewhere = {"remote_host": "127.0.0.1", "remote_port": free_port()}  # nothing listens: no answer, nothing
        with monkeypatch.context() as m:
            m.setattr(mooncake_channel, "ASK_TIMEOUT_MS", 300)  # the wait for an answer, 5 s, cut to what this needs
            assert consumer.stored_blocks_from(keys, elsewhere) == 0
        assert consumer.stored_blocks_from(keys, {"remote_bootstrap_addr": "no-such-host!:1"}) == 0  # zmq refuses it
        nixl = {k: remote[k] for k in ("remote_host", "remote_port")}
        assert consumer.stored_blocks_from(keys, nixl) == 3
        assert consumer.load([BlockTransfer(k, 3 - i, nixl) for i, k in enumerate(keys)]) == []
        assert all(torch.equal(cache[:, 3 - i], source[:, i]) for i in range(3))
        assert producer.stats()["blocks_held"] == 0  # released to the producer the request named
        # Side channels kept open: max_remote_producers, the least recently named closed first.
        assert list(consumer.producers) == [remote["remote_bootstrap_addr"]]
    finally:
        consumer.close()
        producer.close()
