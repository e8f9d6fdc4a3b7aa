"""The OpenAI-compatible server, end to end: real `modserve serve` processes on 127.0.0.1,
driven by the official openai client (and httpx where the raw bytes matter).

The engines live in the server processes, out of reach of conftest's KV-leak guard,
so the last tests check through /metrics that every block came back.
"""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_process import (Server, launch as _launch, stop as _stop, wait_for as _wait_for,
                            wait_healthy as _wait_healthy)

MODEL = "tiny-llama"
KEY = "sekret-key"
GREEDY = dict(temperature=0.0, max_tokens=24, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def servers(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("servers")
    common = ["--model", llama_dir, "--served-model-name", MODEL, "--num-kv-blocks", "256"]
    main = _launch(tmp, "main", *common, "--max-model-len", "512")
    # One running sequence and one waiting request at most: easy to overload on purpose.
    guarded = _launch(tmp, "guarded", *common, "--max-num-seqs", "1", "--max-waiting-requests", "1",
                      env={"MODSERVE_API_KEY": KEY})
    try:
        _wait_healthy(main)
        _wait_healthy(guarded)
        yield main, guarded
    finally:
        _stop(main)
        _stop(guarded)


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def guarded(servers) -> Server:
    return servers[1]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


# -- basics -----------------------------------------------------------------------------------


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_shape_and_usage(server, client):
    r = client.completions.create(model=MODEL, prompt="Hello there", **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    ntok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello there"}).json()["count"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (ntok, 24, ntok + 24)
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [5, 6]}).json()["prompt"]


def test_chat_shape_and_usage(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    ntok = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["count"]
    assert r.usage.prompt_tokens == ntok and r.usage.completion_tokens == 24


def test_token_id_prompts_and_prompt_lists(client):
    r = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens <= 6
    r = client.completions.create(model=MODEL, prompt=["a b", "c d"], n=2, max_tokens=2, temperature=1, seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]


def test_echo(client):
    r = client.completions.create(model=MODEL, prompt="Echo me", echo=True, **GREEDY)
    assert r.choices[0].text.startswith("Echo me")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Echo me", echo=True, stream=True, **GREEDY))
    assert streamed == r.choices[0].text


# -- streaming ------------------------------------------------------------------------------------


def test_streamed_text_equals_whole_text(client):
    whole = client.completions.create(model=MODEL, prompt="The river", **GREEDY).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="The river", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

    messages = [{"role": "user", "content": "Tell me about the river"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY).choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sse_wire_format_and_include_usage(server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert all(json.loads(e[6:])["usage"] is None for e in events[:-2])


def test_chat_stream_include_usage(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True, n=2, temperature=1.0, seed=5,
        max_tokens=7, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts[0] and texts[1]


def test_n2_with_seed(client):
    kw = dict(model=MODEL, prompt="Once upon", n=2, temperature=1.0, seed=7, max_tokens=12,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text != r.choices[1].text
    assert r.usage.completion_tokens == 24
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {0: r.choices[0].text, 1: r.choices[1].text}


def test_seed_reproduces(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="Seeded", temperature=1.0, seed=seed, max_tokens=16,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt="Stop here", **GREEDY).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt="Stop here", stop=[stop, "\x00never"], **GREEDY)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="Stop here", stop=stop, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Log", logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 24
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy: the best one
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = [t for c in client.completions.create(model=MODEL, prompt="Log", logprobs=3, stream=True, **GREEDY)
                for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       logprobs=True, top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 24
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 and t.bytes is not None for t in content)
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], **GREEDY)
    assert plain.choices[0].logprobs is None


def test_vllm_extras(client):
    r = client.completions.create(model=MODEL, prompt="Extras", temperature=0.9, seed=3, max_tokens=8,
                                  extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.2,
                                              "min_tokens": 8, "stop_token_ids": [3], "priority": 1})
    assert r.usage.completion_tokens == 8


def test_sixteen_concurrent_streams(server, client):
    prompts = [f"Client {i} says" for i in range(16)]

    def run(i: int) -> tuple[int, int, int, str]:
        n = 8 + i
        text, usage = "", None
        for chunk in client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=n, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}):
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return n, usage.completion_tokens, usage.prompt_tokens, text

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(16)))
    for i, (n, completion_tokens, prompt_tokens, text) in enumerate(results):
        assert completion_tokens == n and text
        assert prompt_tokens == httpx.post(f"{server.url}/tokenize", json={"prompt": prompts[i]}).json()["count"]


# -- bad requests ------------------------------------------------------------------------------------

LONG = "hello " * 600  # > max_model_len=512 tokens
BAD = [
    # (path, body, status, param)
    ("/v1/completions", b'{"prompt": "x", ', 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "x", "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),  # over max_logprobs (20)
    ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids.0"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**7]}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("/v1/no-such-route", {}, 404, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{p}:{s}:{q}" for p, _, s, q in BAD])
def test_bad_request(server, path, body, status, param):
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if param:
        assert param.split(".")[0] in error["message"]


def test_bad_requests_leave_the_server_healthy(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    assert httpx.get(f"{server.url}/v1/completions").status_code == 405
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="Still fine?", **GREEDY).usage.completion_tokens == 24


# -- protection --------------------------------------------------------------------------------------


def test_api_key(guarded):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{guarded.url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        guarded.client("wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    r = guarded.client(KEY).completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    assert r.choices[0].text is not None


def test_overload_gets_503_with_retry_after(guarded):
    client = guarded.client(KEY)
    long = client.completions.create(model=MODEL, prompt="long", max_tokens=1500, stream=True,
                                     extra_body={"ignore_eos": True})
    next(iter(long))  # it runs: max_num_seqs=1 leaves no room for another
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.completions.create, model=MODEL, prompt="wait", max_tokens=2)
        _wait_for(lambda: guarded.metrics()["modserve_num_requests_waiting"] == 1)
        r = httpx.post(f"{guarded.url}/v1/completions", json={"prompt": "one too many"},
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_overloaded"
        long.close()  # frees the slot: the waiting request now runs
        assert waiting.result(timeout=30).usage.completion_tokens >= 1


def test_disconnect_mid_stream_frees_blocks(server):
    before = server.metrics()
    body = {"model": MODEL, "prompt": "Disconnect me", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.metrics()["modserve_kv_blocks_used"] > 0
    # Leaving the block closed the connection mid-stream.
    _wait_for(lambda: server.metrics()["modserve_kv_blocks_used"] == 0)
    after = server.metrics()
    assert after["modserve_num_requests_running"] == 0
    aborted = "modserve_requests_finished_total{finish_reason=abort}"
    assert after[aborted] == before.get(aborted, 0) + 1
    assert after["modserve_generation_tokens_total"] - before["modserve_generation_tokens_total"] < 400


def test_metrics_parse(server):
    m = server.metrics()
    for name in ("modserve_num_requests_running", "modserve_num_requests_waiting", "modserve_kv_blocks_used",
                 "modserve_kv_blocks_free", "modserve_num_preemptions_total", "modserve_prompt_tokens_total",
                 "modserve_generation_tokens_total", "modserve_time_to_first_token_seconds_count",
                 "modserve_inter_token_latency_seconds_count", "modserve_e2e_request_latency_seconds_count",
                 "modserve_requests_finished_total{finish_reason=length}"):
        assert name in m, name
    assert m["modserve_time_to_first_token_seconds_count"] > 0 and m["modserve_prompt_tokens_total"] > 0
    assert m["modserve_requests_finished_total{finish_reason=stop}"] > 0


# -- the end ---------------------------------------------------------------------------------------


def test_every_block_is_free_at_the_end(servers):
    for s in servers:
        _wait_for(lambda: s.metrics()["modserve_kv_blocks_used"] == 0)
        m = s.metrics()
        assert m["modserve_num_requests_running"] == m["modserve_num_requests_waiting"] == 0


def test_sigterm_shuts_down_cleanly(servers):
    for s in servers:
        # uvicorn re-raises the signal once it has shut down, so the exit reads as SIGTERM's.
        assert _stop(s) in (0, -signal.SIGTERM)
        log = s.log.read_text()
        assert "Application shutdown complete" in log and "engine stopped" in log, log
        assert "Traceback" not in log, log
