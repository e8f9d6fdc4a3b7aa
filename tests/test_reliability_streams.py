"""Response size and back-pressure against a real `modserve serve` process: a request that
asks for too big an answer is refused before it runs, a large answer is built off the
event loop, and a client that does not read its stream loses its place in the batch.

Both failed before: 128 choices repeating a 1,000-token prompt's logprobs made a 210 MB
body built on the event loop (/health blocked 30 s), and streams whose clients read
nothing held every running slot until their last token.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import pytest
from transformers import AutoTokenizer

from modserve.core.config import EngineConfig
from modserve.engine.engine import LLMEngine
from modserve.core.sampling_params import SamplingParams
from modserve.server.async_engine import StreamStalled
from modserve.server.replicas import ReplicaSet, SplitStream, build_engines
from modserve.server.response_size import ResponseBound
from server_process import Server, launch, stop, wait_for, wait_healthy

MAX_NUM_SEQS = 4
STALL = 1.0  # the server's --stream-stall-timeout, seconds
MAX_RESPONSE_BYTES = 40 * 2**20
PROMPT = [5 + i % 4000 for i in range(1000)]  # token ids of the tiny vocabulary
# Each choice repeats its prompt's logprobs: ~1.7 MiB of JSON a choice here.
SCORED = dict(max_tokens=1, echo=True, logprobs=5, prompt_logprobs=20)
VICTIM = dict(prompt="The victim's prompt", max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("streams")
    s = launch(tmp, "streams", "--model", llama_dir, "--num-threads", "1", "--max-model-len", "2048",
               "--num-kv-blocks", "1024", "--max-num-seqs", str(MAX_NUM_SEQS), "--stream-stall-timeout", str(STALL),
               "--max-response-bytes", str(MAX_RESPONSE_BYTES))
    try:
        wait_healthy(s)
        yield s
    finally:
        stop(s)


@contextmanager
def health_probe(server: Server) -> Iterator[list[float]]:
    """/health's latency every 0.1 s while the block runs."""
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            start = time.monotonic()
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
            latencies.append(time.monotonic() - start)
            done.wait(0.1)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        yield latencies
    finally:
        done.set()
        thread.join()


def stream_text(server: Server, body: dict) -> str:
    text = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += [c["text"] for c in json.loads(line[len("data: "):])["choices"]]
    return "".join(text)


def test_a_response_too_big_is_refused_and_a_big_one_leaves_the_loop_free(server, llama_dir):
    reference = stream_text(server, VICTIM)
    # 8 prompts x n=4: ~56 MiB of prompt logprobs, over the 40 MiB bound, refused at once.
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [PROMPT] * 8, "n": 4, **SCORED}, timeout=60)
    assert r.status_code == 400, r.text[:200]
    error = r.json()["error"]
    assert error["param"] == "prompt_logprobs" and f"max_response_bytes={MAX_RESPONSE_BYTES}" in error["message"]

    # 4 prompts x n=4: ~28 MB, allowed; /health answers and a stream runs meanwhile.
    with health_probe(server) as latencies:
        victim: list[str] = []
        thread = threading.Thread(target=lambda: victim.append(stream_text(server, VICTIM)))
        thread.start()
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [PROMPT] * 4, "n": 4, **SCORED}, timeout=120)
        thread.join()
    assert r.status_code == 200, r.text[:200]
    choices = r.json()["choices"]
    assert len(choices) == 16 and all(len(c["prompt_logprobs"]) == len(PROMPT) for c in choices)
    assert all(len(c["logprobs"]["tokens"]) == len(PROMPT) + 1 for c in choices)  # its prompt's, then its token
    assert victim == [reference]
    assert max(latencies) < 1.0, latencies

    # The bound means what it says: the estimate is within a quarter of the real size.
    vocab = AutoTokenizer.from_pretrained(llama_dir).get_vocab()
    estimate = sum(ResponseBound.of(2**40, vocab).completion_parts(4, [len(PROMPT)] * 4, 1, 2048, True, 5, 20).values())
    assert 0.75 < len(r.content) / estimate < 1.25, (len(r.content), estimate)


def slow_reader(server: Server, body: dict) -> socket.socket:
    """A client that sends a streamed request and never reads. Its small receive buffer and
    segment size keep the server's socket buffers small too (loopback's grow to megabytes),
    so the server's sends soon block."""
    raw = json.dumps({**body, "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    s.connect(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
    return s


def read_to_end(s: socket.socket, timeout: float = 20) -> bytes:
    s.settimeout(timeout)
    got = bytearray()
    while b"data: [DONE]" not in got[-64:]:
        chunk = s.recv(1 << 16)
        assert chunk, "the connection closed before [DONE]"
        got += chunk
    return bytes(got)


def test_clients_that_do_not_read_lose_their_slots(server):
    reference = stream_text(server, VICTIM)
    before = server.metrics()
    # Each: a first chunk of ~190 KB (the echoed prompt's logprobs), then 1,000 more tokens.
    body = {"prompt": PROMPT, "max_tokens": 1040, "ignore_eos": True, "echo": True, "logprobs": 5}
    slow = [slow_reader(server, body) for _ in range(2 * MAX_NUM_SEQS)]
    try:
        with health_probe(server) as latencies:
            wait_for(lambda: server.metrics()["modserve_num_requests_running"] > 0)
            start = time.monotonic()
            assert stream_text(server, VICTIM) == reference
            took = time.monotonic() - start
            # Two rounds of slow streams ahead of it, each aborted STALL after it blocked.
            assert took < 2 * STALL + 8, took
            key = "modserve_requests_finished_total{finish_reason=stalled}"
            wait_for(lambda: server.metrics().get(key, 0) - before.get(key, 0) == len(slow))
            after = server.metrics()
            assert after["modserve_num_requests_running"] == 0 and after["modserve_kv_blocks_used"] == 0
        assert max(latencies) < 1.0, latencies
        # A client that reads at last gets the stream's end: the error, then [DONE].
        tail = read_to_end(slow[0]).decode(errors="replace")
        assert '"code":"stream_stalled"' in tail.replace(" ", "") and "stream_stall_timeout=1" in tail
    finally:
        for s in slow:
            s.close()
    wait_for(lambda: server.metrics()["modserve_kv_blocks_used"] == 0)


# -- in-process: a stream split over data-parallel replicas stalls as one ---------------------------
def test_a_split_stream_that_is_not_read_is_aborted_on_every_replica(llama_dir):
    config = EngineConfig(model=llama_dir, num_kv_blocks=64, max_model_len=256, num_threads=1,
                          data_parallel_size=2, stream_stall_timeout=0.2)
    engines = build_engines(config, lambda c: LLMEngine(c, progress=False))

    async def main() -> None:
        rs = ReplicaSet(engines, routing="load")
        rs.start()
        try:
            stream = rs.submit([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=200, ignore_eos=True))
            assert isinstance(stream, SplitStream) and rs.num_in_flight == 2
            for _ in range(200):  # read nothing: its outputs wait, and the next one past 0.2 s aborts it
                if rs.num_in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            assert rs.num_in_flight == 0
            with pytest.raises(StreamStalled, match="stream_stall_timeout=0.2"):
                await stream.__anext__()
            for _ in range(100):  # the engine threads apply the aborts
                if not any(e.requests for e in engines):
                    break
                await asyncio.sleep(0.01)
        finally:
            rs.stop()

    asyncio.run(main())
