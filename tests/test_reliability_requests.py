"""Request-level bounds, strict request types and HTTP hygiene against a real `modserve serve`.

Each limit of a request field held alone but not in combination (prompts x n, thousands
of stop strings), a tiny temperature sampled garbage, strings passed for numbers, a
key given twice in a JSON body or an Authorization header given twice was read one way
of two, and a body framed by both Content-Length and Transfer-Encoding let a request
pipelined behind it through. Each test is one of those classes.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import torch

from modserve.core.sampling_params import SamplingParams
from modserve.samplers.default import DefaultSampler
from modserve.server.json_body import DuplicateKey, loads
from server_process import Server, launch, stop, wait_for, wait_healthy
from test_reliability import AUTH, KEY, MODEL, assert_shaped_4xx, post, stream_text

MAX_NUM_SEQS = 8
MAX_SEQUENCES = 16
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 64
MAX_STOP_TOKEN_IDS = 4
MAX_LOGPROBS = 5
MAX_MODEL_LEN = 512
VICTIM = {"prompt": "The victim's stream", "temperature": 0.0, "max_tokens": 200, "ignore_eos": True}
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory) -> Server:
    s = launch(tmp_path_factory.mktemp("requests"), "requests", "--model", llama_dir, "--served-model-name", MODEL,
               "--num-threads", "1", "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256",
               "--max-num-seqs", str(MAX_NUM_SEQS), "--max-sequences-per-request", str(MAX_SEQUENCES),
               "--max-stop-strings", str(MAX_STOP_STRINGS), "--max-stop-chars", str(MAX_STOP_CHARS),
               "--max-stop-token-ids", str(MAX_STOP_TOKEN_IDS), "--max-logprobs", str(MAX_LOGPROBS),
               env={"MODSERVE_API_KEY": KEY})
    try:
        wait_healthy(s)
        yield s
    finally:
        stop(s)


def _error(r: httpx.Response, param: str, names: str) -> None:
    assert r.status_code == 400, r.text[:300]
    error = assert_shaped_4xx(r, param)
    assert names in error["message"], error


# -- class 3 and 4: a hostile request is refused and a concurrent stream keeps its text and pace

HOSTILE = {
    # 64 prompts x n 8: each within its own limit (max_waiting_requests, max_num_seqs), together 512 sequences
    "prompts_x_n": ({"prompt": ["hog"] * 64, "n": 8, "temperature": 1.0, "max_tokens": 50, "ignore_eos": True},
                    "n", "max_sequences_per_request"),
    # 20,000 stop strings, scanned on every token of each of 8 sequences
    "stop_strings": ({"prompt": "stop", "n": 8, "stop": [f"never {i}" for i in range(20_000)], "max_tokens": 200,
                      "ignore_eos": True}, "stop", "max_stop_strings"),
}


def _timed_stream(server: Server, body: dict) -> tuple[str, list[dict], float]:
    started = time.perf_counter()
    text, events = stream_text(server, body)
    return text, events, time.perf_counter() - started


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_request_is_refused_and_a_later_stream_keeps_its_text_and_pace(server, name):
    body, param, names = HOSTILE[name]
    _timed_stream(server, VICTIM)  # warm
    reference, _, alone = _timed_stream(server, VICTIM)
    with ThreadPoolExecutor(1) as pool:
        hostile = pool.submit(post, server, "/v1/completions", body, 60)
        time.sleep(0.3)  # it has arrived (and, were it accepted, been queued)
        health = time.perf_counter()
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        health = time.perf_counter() - health
        text, events, took = _timed_stream(server, VICTIM)
        print(f"{name}: victim alone {alone:.2f} s, after the hostile request {took:.2f} s, /health {health:.3f} s")
        assert text == reference and events[-2]["choices"][0]["finish_reason"] == "length"
        # The bound: the stream runs at its own pace (twice its time alone, plus scheduling noise).
        assert took < 2 * alone + 0.5, (alone, took)
        assert health < 1.0
        _error(hostile.result(), param, names)


@pytest.mark.parametrize("path, fields, param, names", [
    ("/v1/completions", {"prompt": ["p"] * 3, "n": 6, "best_of": 6}, "n", "max_sequences_per_request=16"),
    ("/v1/completions", {"prompt": ["p"] * (MAX_SEQUENCES + 1)}, "prompt", "max_sequences_per_request=16"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 9}, "stop", "max_stop_strings=8"),
    ("/v1/completions", {"prompt": "x", "stop": ["y" * 40, "z" * 25]}, "stop", "max_stop_chars=64"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": "s" * 65}, "stop", "max_stop_chars=64"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [3, 4, 5, 6, 7]}, "stop_token_ids",
     "max_stop_token_ids=4"),
    ("/v1/completions", {"prompt": "x", "stop": ""}, "stop", "non-empty"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["end", ""]}, "stop", "non-empty"),
])
def test_request_bounds_are_400s_naming_the_limit(server, path, fields, param, names):
    body = {"messages": CHAT} if path.endswith("chat/completions") else {}
    _error(post(server, path, {**body, **fields}), param, names)


# -- class 5: a tiny temperature is raised to vLLM's floor, not sampled as 1 / 0 -----------------

def test_a_tiny_temperature_samples_as_vllms_floor(server):
    def text(temperature: float) -> str:
        r = post(server, "/v1/completions", {"prompt": "Once upon a time", "temperature": temperature, "seed": 3,
                                             "max_tokens": 12, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    floor = text(0.01)
    assert text(1e-40) == floor and text(1e-5) == floor


def test_offline_params_and_the_sampler_keep_a_tiny_temperature_finite():
    assert SamplingParams(temperature=1e-40).temperature == 0.01
    assert SamplingParams(temperature=0.0).temperature == 0.0 and SamplingParams(temperature=0.5).temperature == 0.5
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["a", ""])
    # A batch built around SamplingParams: the sampler's own floor keeps logits / t finite.
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [3.0, 0.0, 1.0, 9.0]])  # [B=2, V=4]
    batch = SimpleNamespace(temperature=torch.tensor([1e-40, 1e-40]), any_top_k=False, any_top_p=False,
                            any_min_p=False, argmax_invariant_processors=())
    shaped = DefaultSampler.__new__(DefaultSampler)._shape(logits, batch)
    assert torch.isfinite(shaped).all() and shaped.softmax(-1).argmax(-1).tolist() == [2, 3]


# -- class 8: ambiguous HTTP --------------------------------------------------------------------

def _raw(server: Server, request: bytes) -> bytes:
    """Everything the server sends back on one connection until it closes it (or 5 s pass)."""
    host, port = server.url.removeprefix("http://").split(":")
    reply = b""
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(request)
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except TimeoutError:
            pass
    return reply


def test_two_authorization_headers_are_refused(server):
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    for first, second in (("wrong", KEY), (KEY, "wrong"), (KEY, KEY)):
        reply = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + first.encode() + b"\r\nAuthorization: Bearer " + second.encode()
                     + b"\r\nConnection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert reply.startswith(b"HTTP/1.1 400 "), reply
        error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["param"] == "authorization" and "Authorization" in error["message"], error


def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(server):
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    chunked = hex(len(body))[2:].encode() + b"\r\n" + body + b"\r\n0\r\n\r\n"
    smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    reply = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(chunked)).encode()
                 + b"\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked + smuggled)
    assert reply.startswith(b"HTTP/1.1 400 "), reply
    assert reply.count(b"HTTP/1.1 ") == 1, reply  # the pipelined request was never answered
    head, rest = reply.split(b"\r\n\r\n", 1)
    assert b"connection: close" in head.lower()
    assert json.loads(rest)["error"]["param"] == "transfer-encoding"


# -- class 9: strict types, one key once, min_tokens against the context -------------------------

@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"max_tokens": "3"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 3.0}, "max_tokens"),
    ("/v1/completions", {"temperature": "0"}, "temperature"),
    ("/v1/completions", {"n": True}, "n"),
    ("/v1/completions", {"echo": "true"}, "echo"),
    ("/v1/completions", {"stream": 1}, "stream"),
    ("/v1/completions", {"stop": 5}, "stop"),
    ("/v1/completions", {"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"strict": "yes"}}},
     "response_format.json_schema.strict"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"max_completion_tokens": "8"}, "max_completion_tokens"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": 0}, "add_special_tokens"),
    ("/detokenize", {"tokens": ["1"]}, "tokens.0"),
])
def test_values_of_the_wrong_type_are_refused_not_coerced(server, path, fields, param):
    body = {"messages": CHAT} if path.endswith("chat/completions") else {"prompt": "x"} \
        if path == "/v1/completions" else {}
    r = post(server, path, {**body, **fields})
    assert r.status_code == 400, r.text
    assert_shaped_4xx(r, param)


def test_a_float_field_takes_an_integer(server):
    r = post(server, "/v1/completions", {"prompt": "x", "temperature": 0, "top_p": 1, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", '{"prompt": "x", "max_tokens": 3, "max_tokens": 5}', "max_tokens"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "role": "system", "content": "x"}]}', "role"),
    ("/tokenize", '{"prompt": "a", "prompt": "b"}', "prompt"),
])
def test_a_key_given_twice_is_refused(server, path, raw, param):
    r = httpx.post(f"{server.url}{path}", content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "twice" in assert_shaped_4xx(r, param)["message"]


def test_duplicate_keys_are_found_at_any_depth():
    assert loads(b'{"a": [{"b": 1}, {"b": 2}], "c": {"b": 3}}') == {"a": [{"b": 1}, {"b": 2}], "c": {"b": 3}}
    with pytest.raises(DuplicateKey) as e:
        loads('{"a": [{"x": 1, "y": 2, "x": 3}]}')
    assert e.value.key == "x"


@pytest.mark.parametrize("path, fields, param, says", [
    ("/v1/chat/completions", {"min_tokens": MAX_MODEL_LEN}, "min_tokens", f"max_model_len={MAX_MODEL_LEN}"),
    ("/v1/completions", {"min_tokens": MAX_MODEL_LEN, "max_tokens": None}, "min_tokens",
     f"max_model_len={MAX_MODEL_LEN}"),
    # max_tokens past the context is refused first, as vLLM does: min_tokens is at most max_tokens
    ("/v1/completions", {"min_tokens": MAX_MODEL_LEN - 1, "max_tokens": MAX_MODEL_LEN}, "max_tokens",
     f"maximum context length is {MAX_MODEL_LEN} tokens"),
])
def test_min_tokens_must_fit_what_the_prompt_leaves(server, path, fields, param, says):
    body = {"messages": CHAT} if path.endswith("chat/completions") else {"prompt": "hello"}
    _error(post(server, path, {**body, **fields}), param, says)
    r = post(server, path, {**body, **fields, "min_tokens": 2, "max_tokens": 3})
    assert r.status_code == 200, r.text


# -- the logprobs maxima ------------------------------------------------------------------------

@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ("/v1/chat/completions", {"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
])
def test_logprobs_over_max_logprobs_are_refused(server, path, fields, param):
    body = {"messages": CHAT} if path.endswith("chat/completions") else {"prompt": "x"}
    _error(post(server, path, {**body, **fields, "max_tokens": 2}), param, f"max_logprobs={MAX_LOGPROBS}")
    at_most = {k: MAX_LOGPROBS if type(v) is int else v for k, v in fields.items()}
    r = post(server, path, {**body, **at_most, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_vllms_max_logprobs_flag_is_the_config_key(llama_dir):
    from modserve import cli

    args = cli.build_parser().parse_args(["serve", llama_dir, "--max-logprobs", "7"])
    assert cli.config_from_args(args).max_logprobs == 7


def test_no_block_leaked_and_no_request_left(server):
    wait_for(lambda: server.metrics()["modserve_num_requests_running"] == 0
             and server.metrics()["modserve_num_requests_waiting"] == 0, timeout=60)
    m = server.metrics()
    assert m["modserve_kv_blocks_used"] == 0, m
