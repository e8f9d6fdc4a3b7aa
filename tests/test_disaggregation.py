"""Disaggregated prefill and decode: a producer server, a consumer server and the router, as
real processes, the KV moving between them through shared memory (``kv_connector: shm``).

Through the router a request's greedy tokens are one engine's; the consumer loads every
whole block of the prompt but the last token's (its /metrics count them) and computes the
rest; and once the servers stop no shared-memory segment is left.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from server_process import launch, stop, wait_healthy
from test_router import launch_router, wait_listening

from modserve import LLM, SamplingParams

MODEL = "tiny-llama"
BLOCK = 16
LOADED = "modserve_kv_connector_blocks_loaded_total"
SAVED = "modserve_kv_connector_blocks_saved_total"
PROMPTS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch " * 3,
    "In a hole in the ground there lived a hobbit, not a nasty dirty wet hole filled with worms " * 2,
    "Call me Ishmael. Some years ago, never mind how long precisely, having little money",
]
STREAMED = "It was the best of times, it was the worst of times, it was the age of wisdom, " * 2


def shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("ms")}


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX shared memory as /dev/shm (Linux)")
def test_producer_consumer_router_answer_as_one_engine(llama_dir, tmp_path):
    before = shm_segments()
    common = ["--model", llama_dir, "--served-model-name", MODEL, "--num-kv-blocks", "128",
              "--max-model-len", "256", "--num-threads", "1", "--kv-connector", "shm"]
    producer = launch(tmp_path, "producer", *common, "--kv-role", "producer")
    consumer = launch(tmp_path, "consumer", *common, "--kv-role", "consumer")
    router = None
    try:
        wait_healthy(producer)
        wait_healthy(consumer)
        router = launch_router(tmp_path, "router", producer.url, consumer.url)
        wait_listening(router)
        client = router.client()
        got, usage = [], []
        for prompt in PROMPTS:
            out = client.completions.create(model=MODEL, prompt=prompt, temperature=0.0, max_tokens=12,
                                            extra_body={"ignore_eos": True})
            got.append(out.choices[0].text)
            usage.append(out.usage.prompt_tokens)
        stream = client.completions.create(model=MODEL, prompt=STREAMED, temperature=0.0, max_tokens=12,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks = list(stream)
        got.append("".join(chunk.choices[0].text for chunk in chunks if chunk.choices))
        usage.append(chunks[-1].usage.prompt_tokens)

        loaded = consumer.metrics().get(LOADED, 0)
        saved = producer.metrics().get(SAVED, 0)
        # The consumer computed at most one block of each prompt: it loaded all the others.
        assert loaded == sum((n - 1) // BLOCK for n in usage)
        assert min(usage) > 2 * BLOCK
        assert saved >= sum(n // BLOCK for n in usage)
        assert consumer.metrics().get(SAVED, 0) == 0
    finally:
        for server in (router, producer, consumer):
            if server is not None:
                stop(server)
    assert shm_segments() == before, "a shared-memory segment outlived the producer"
    # The producer unlinked its segments itself: Python's resource tracker, the safety net for a
    # process that dies, found none to clean up (it would warn of "leaked shared_memory objects").
    assert "leaked shared_memory" not in producer.log.read_text()

    llm = LLM(llama_dir, dtype="float32", max_model_len=256, num_kv_blocks=128, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate([*PROMPTS, STREAMED], params, use_tqdm=False)]
    llm.engine.shutdown()
    assert got == want
