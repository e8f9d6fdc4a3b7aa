"""vLLM's token-in/token-out route, ``POST /inference/v1/generate``, and ``GET /load``, on a real
server driven by plain httpx: greedy ids as /v1/completions', streaming, abort on disconnect,
OpenAI-shaped 400s for bad input and for the request limits /v1/completions has."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import serving, wait_for
from transformers import AutoTokenizer

MODEL = "tiny-llama"
MAX_MODEL_LEN = 2048  # room for a request long enough to be cut off mid-way


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("generate"), "generate", "--model", llama_dir, "--served-model-name", MODEL,
                 "--num-kv-blocks", "256", "--max-model-len", str(MAX_MODEL_LEN)) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def prompt(server) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": "In the beginning God created"}).json()["tokens"]


def _generate(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=60)


def _kv_blocks_used(server) -> float:
    return _metric(server, "modserve_kv_blocks_used")


def test_greedy_ids_equal_completions(server, tokenizer, prompt):
    greedy = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    r = _generate(server, {"token_ids": prompt, "sampling_params": {**greedy, "logprobs": 0}, "request_id": "mine"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["request_id"] == "mine" and body["model"] == MODEL
    (choice,) = body["choices"]
    ids = choice["token_ids"]
    assert len(ids) == 16 and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 16, "total_tokens": len(prompt) + 16}
    c = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, **greedy, "logprobs": 0}, timeout=60).json()
    lp = c["choices"][0]["logprobs"]
    # completions names each token by its text alone; both give each token's logprob
    assert lp["tokens"] == [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    mine = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert mine == pytest.approx(lp["token_logprobs"], abs=1e-4)
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in ids]
    assert c["choices"][0]["text"] == tokenizer.decode(ids, skip_special_tokens=True)


def test_logprobs_n_and_prompt_logprobs(server, prompt):
    sp = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 2, "n": 2, "prompt_logprobs": 1}
    body = _generate(server, {"token_ids": prompt, "sampling_params": sp}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["token_ids"] == body["choices"][1]["token_ids"]  # greedy
    for entry in body["choices"][0]["logprobs"]["content"]:
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["token"].startswith("token_id:")
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == len(prompt)
    assert str(prompt[1]) in body["prompt_logprobs"][1]


def test_nulls_take_the_defaults(server, prompt):
    sp = {"max_tokens": 3, "temperature": None, "top_k": None, "seed": None, "stop": None, "logprobs": None}
    r = _generate(server, {"token_ids": prompt, "sampling_params": sp, "stream": None, "request_id": None})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) <= 3 and r.json()["request_id"].startswith("gen-")


def test_streaming_reassembles(server, prompt):
    sp = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = _generate(server, {"token_ids": prompt, "sampling_params": sp}).json()["choices"][0]["token_ids"]
    body = {"token_ids": prompt, "sampling_params": sp, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/inference/v1/generate", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
    assert streamed == whole
    assert [choice["finish_reason"] for c in chunks for choice in c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert len({c["request_id"] for c in chunks}) == 1


def _metric(server, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and s.labels == labels)


def test_disconnect_aborts_and_frees_kv(server, prompt):
    aborted = dict(name="modserve_requests_finished_total", finish_reason="abort")
    before, generated = _metric(server, **aborted), _metric(server, "modserve_generation_tokens_total")
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 2000, "ignore_eos": True}, "stream": True}
    with httpx.stream("POST", f"{server.url}/inference/v1/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)

        def running() -> bool:
            load = httpx.get(f"{server.url}/load").json()
            return load["num_requests_running"] == 1 and load["kv_cache_usage_perc"] > 0 and load["server_load"] == 1

        wait_for(running)
    # Leaving the block closed the connection mid-stream.
    wait_for(lambda: _kv_blocks_used(server) == 0)
    assert _metric(server, **aborted) == before + 1
    assert _metric(server, "modserve_generation_tokens_total") - generated < 2000
    load = httpx.get(f"{server.url}/load").json()
    assert load == {"server_load": 0, "num_requests_waiting": 0, "num_requests_running": 0,
                    "kv_cache_usage_perc": 0.0}


LONG = list(range(5, 5 + MAX_MODEL_LEN + 1))
BAD = [
    ({"token_ids": [], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [-1], "sampling_params": {}}, "token_ids.0"),
    ({"token_ids": ["a"], "sampling_params": {}}, "token_ids.0"),
    ({"token_ids": [10**7], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [5]}, "sampling_params"),
    ({"token_ids": [5], "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    ({"token_ids": [5], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"token_ids": [5], "sampling_params": {"n": 1000}}, "sampling_params.n"),
    ({"token_ids": [5], "sampling_params": {"logprobs": 21}}, "sampling_params.logprobs"),
    ({"token_ids": [5], "sampling_params": {"stop": ["x"] * 65}}, "sampling_params.stop"),
    ({"token_ids": [5], "sampling_params": {"stop_token_ids": [10**7]}}, "sampling_params.stop_token_ids"),
    ({"token_ids": [5], "sampling_params": {"logit_bias": {"x": 1}}}, "sampling_params.logit_bias"),
    ({"token_ids": [5], "sampling_params": {}, "cache_salt": "s"}, "cache_salt"),
    ({"token_ids": [5], "sampling_params": {}, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"token_ids": [5], "sampling_params": {"prompt_logprobs": 1}, "stream": True}, "sampling_params.prompt_logprobs"),
    ({"token_ids": [5], "sampling_params": {}, "unknown": 1}, "unknown"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_an_openai_400(server, body, param):
    r = _generate(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"].startswith(param)


def _error(server, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_the_limits_of_completions_apply(server):
    """A prompt past max_model_len and max_tokens past the context left: completions' 400s,
    naming the same limit."""
    mine = _error(server, "/inference/v1/generate", {"token_ids": LONG, "sampling_params": {}})
    theirs = _error(server, "/v1/completions", {"prompt": LONG})
    assert mine["param"] == "token_ids" and "max_model_len" in mine["message"]
    assert mine["message"].endswith(theirs["message"].removeprefix("prompt"))  # "token_ids: prompt is 2049 tokens..."
    mine = _error(server, "/inference/v1/generate", {"token_ids": [5] * 10, "sampling_params": {"max_tokens": 2100}})
    theirs = _error(server, "/v1/completions", {"prompt": [5] * 10, "max_tokens": 2100})
    assert mine["param"] == "sampling_params.max_tokens" and f"context length is {MAX_MODEL_LEN}" in mine["message"]
    assert mine["message"].removeprefix("sampling_params.max_tokens") == theirs["message"].removeprefix("max_tokens")


def test_wrong_model_is_404(server):
    r = _generate(server, {"token_ids": [5], "sampling_params": {}, "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_request_phase_histograms_in_modserve_naming(server):
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    for phase in ("queue", "prefill", "decode", "inference"):
        assert families[f"modserve_request_{phase}_time_seconds"].type == "histogram"
    count = next(s.value for s in families["modserve_request_decode_time_seconds"].samples if s.name.endswith("_count"))
    assert count > 0
    assert "modserve_kv_blocks_used" in families and not any(n.startswith("vllm:") for n in families)


def test_every_block_is_free_at_the_end(server):
    wait_for(lambda: _kv_blocks_used(server) == 0)


def test_the_api_key_guards_generate_but_not_load():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from modserve.server.app import APIKeyMiddleware

    async def ok(request):
        return PlainTextResponse("ok")

    app = APIKeyMiddleware(Starlette(routes=[Route("/inference/v1/generate", ok, methods=["POST"]),
                                             Route("/load", ok)]), api_key="k")
    client = TestClient(app)
    assert client.post("/inference/v1/generate").status_code == 401
    assert client.post("/inference/v1/generate", headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.get("/load").status_code == 200
