"""`modserve router` end to end: two real `modserve serve` processes (prefill and decode) on the
tiny checkpoint, the router as a real process in front of them, driven by the official openai
client (httpx where the raw bytes or headers matter).

Without a KV connector the decode server computes the prompt again; what is checked here is the
router's part: the prefill server gets each request once with max_tokens=1 (its /metrics count
one generated token and one finished request per client request), the client gets exactly what
the decode server alone would answer, errors pass through in OpenAI's shape.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_process import Server, free_port, launch, stop, wait_for, wait_healthy

MODEL = "tiny-llama"
KEY = "router-key"
GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})
GENERATED = "modserve_generation_tokens_total"
FINISHED = "modserve_requests_finished_total{finish_reason=length}"
ABORTED = "modserve_requests_finished_total{finish_reason=abort}"


def launch_router(tmp: Path, name: str, prefill: str, decode: str) -> Server:
    port = free_port()
    log = tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "modserve", "--log-level", "info", "router", "--prefill", prefill,
           "--decode", decode, "--port", str(port)]
    with open(log, "w") as f:  # a file, not a pipe: a full pipe would stall the router
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=os.environ.copy())
    return Server(proc, f"http://127.0.0.1:{port}", log)


def wait_listening(server: Server, timeout: float = 60) -> None:
    """Any answer will do: a router before a dead server is up but not healthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, f"router exited ({server.proc.returncode}):\n{server.log.read_text()}"
        try:
            httpx.get(f"{server.url}/v1/models", timeout=5)
            return
        except httpx.TransportError:
            time.sleep(0.2)
    raise TimeoutError(f"router not listening after {timeout} s:\n{server.log.read_text()}")


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory):
    """prefill server, decode server, the router in front of them, and a router whose decode
    server is a port nobody listens on."""
    tmp = tmp_path_factory.mktemp("router")
    common = ["--model", llama_dir, "--served-model-name", MODEL, "--num-kv-blocks", "128",
              "--max-model-len", "256", "--num-threads", "1"]
    key = {"MODSERVE_API_KEY": KEY}  # both servers want it: the router must forward it
    prefill, decode = launch(tmp, "prefill", *common, env=key), launch(tmp, "decode", *common, env=key)
    routers: list[Server] = []
    try:
        wait_healthy(prefill)
        wait_healthy(decode)
        routers.append(launch_router(tmp, "router", prefill.url, decode.url))
        routers.append(launch_router(tmp, "no-decode", prefill.url, f"http://127.0.0.1:{free_port()}"))
        for r in routers:
            wait_listening(r)
        yield prefill, decode, *routers
    finally:
        for s in (*routers, prefill, decode):
            stop(s)


@pytest.fixture(scope="module")
def prefill(stack) -> Server:
    return stack[0]


@pytest.fixture(scope="module")
def decode(stack) -> Server:
    return stack[1]


@pytest.fixture(scope="module")
def router(stack) -> Server:
    return stack[2]


def client(server: Server) -> openai.OpenAI:
    return server.client(KEY)


class PrefillCount:
    """What the prefill server did between ``with`` and its end: it must be one generated token
    and one finished (length) request per client request."""

    def __init__(self, prefill: Server, requests: int) -> None:
        self.prefill, self.requests = prefill, requests

    def __enter__(self) -> "PrefillCount":
        self.before = self.prefill.metrics()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            return

        def delta(name: str) -> float:
            return self.prefill.metrics().get(name, 0) - self.before.get(name, 0)

        wait_for(lambda: delta(FINISHED) >= self.requests)
        assert (delta(GENERATED), delta(FINISHED)) == (self.requests, self.requests)


# -- completions and chat -------------------------------------------------------------------------


def test_completion_is_what_the_decode_server_answers(prefill, decode, router):
    alone = client(decode).completions.create(model=MODEL, prompt="The router said", **GREEDY)
    with PrefillCount(prefill, 1):
        routed = client(router).completions.create(model=MODEL, prompt="The router said", **GREEDY)
    assert routed.choices[0].text == alone.choices[0].text and routed.usage.completion_tokens == 12
    assert routed.model == MODEL


def test_chat_is_what_the_decode_server_answers(prefill, decode, router):
    messages = [{"role": "user", "content": "Route me"}]
    alone = client(decode).chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    with PrefillCount(prefill, 2):
        routed = client(router).chat.completions.create(model=MODEL, messages=messages, **GREEDY)
        # max_completion_tokens is capped for the prefill too: it would win over max_tokens there
        newer = client(router).chat.completions.create(
            model=MODEL, messages=messages, temperature=0.0, max_completion_tokens=12, extra_body={"ignore_eos": True})
    assert routed.choices[0].message.content == alone.choices[0].message.content
    assert newer.choices[0].message.content == alone.choices[0].message.content
    assert newer.usage.completion_tokens == 12


def test_streamed_completion_and_chat(prefill, decode, router):
    """stream_options goes to the decode server only (the prefill one refuses it without a stream)."""
    text = client(decode).completions.create(model=MODEL, prompt="Stream it", **GREEDY).choices[0].text
    messages = [{"role": "user", "content": "Stream it"}]
    reply = client(decode).chat.completions.create(model=MODEL, messages=messages, **GREEDY).choices[0].message.content
    with PrefillCount(prefill, 2):
        chunks = list(client(router).completions.create(model=MODEL, prompt="Stream it", stream=True,
                                                        stream_options={"include_usage": True}, **GREEDY))
        chat = list(client(router).chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    # Content chunks, then the usage alone. (How many content chunks depends on timing: a stream
    # whose reader falls behind the engine's process gets the tokens since its last read merged.)
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices and len(chunks) >= 2
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == reply


def test_stream_is_relayed_chunk_by_chunk(router):
    """The first event arrives long before the last is generated: nothing is buffered."""
    body = {"model": MODEL, "prompt": "Slowly", "max_tokens": 200, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert float(r.headers["x-modserve-prefill-ms"]) > 0 and r.headers["x-request-id"]
        start = time.monotonic()
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        first_s = time.monotonic() - start
        rest = [line for line in lines if line.startswith("data:")]
        total_s = time.monotonic() - start
    assert first.startswith("data: {") and rest[-1] == "data: [DONE]" and len(rest) > 100
    assert first_s < total_s / 2, (first_s, total_s)  # buffered, they would be equal


def test_timing_headers_and_log(router):
    raw = client(router).completions.with_raw_response.create(model=MODEL, prompt="Time me", **GREEDY)
    rid = raw.headers["x-request-id"]
    assert float(raw.headers["x-modserve-prefill-ms"]) > 0 and float(raw.headers["x-modserve-decode-headers-ms"]) > 0
    wait_for(lambda: f"/v1/completions {rid}: prefill " in router.log.read_text())


def test_models_and_health(decode, router):
    assert [m.id for m in client(router).models.list().data] == [MODEL]
    assert client(router).models.retrieve(MODEL).id == MODEL
    r = httpx.get(f"{router.url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


# -- errors ----------------------------------------------------------------------------------------


def same_error(server: Server, router: Server, body: dict, key: str = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    alone = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
    routed = httpx.post(f"{router.url}/v1/completions", json=body, headers=headers)
    assert alone.status_code >= 400
    assert (routed.status_code, routed.json()) == (alone.status_code, alone.json())
    return routed


def test_an_unknown_model_is_the_prefill_servers_404_and_never_decoded(prefill, router):
    r = same_error(prefill, router, {"model": "gpt-17", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.headers["x-modserve-upstream"] == "prefill"
    rid = r.headers["x-request-id"]
    wait_for(lambda: f"{rid}: prefill answered 404" in router.log.read_text())
    with pytest.raises(openai.NotFoundError, match="gpt-17"):
        client(router).completions.create(model="gpt-17", prompt="hi", max_tokens=2)


def test_a_bad_max_tokens_is_the_servers_400(decode, router):
    """The prefill server never sees max_tokens=-1 (it gets 1): the decode server refuses it."""
    r = same_error(decode, router, {"model": MODEL, "prompt": "hi", "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(router).completions.create(model=MODEL, prompt="hi", max_tokens=-1)


def test_a_malformed_body_is_the_servers_400(prefill, router):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    alone = httpx.post(f"{prefill.url}/v1/completions", content=b"{not json", headers=headers)
    routed = httpx.post(f"{router.url}/v1/completions", content=b"{not json", headers=headers)
    assert (routed.status_code, routed.json()) == (alone.status_code, alone.json()) and alone.status_code == 400


def test_the_authorization_header_is_forwarded(prefill, router):
    r = same_error(prefill, router, {"model": MODEL, "prompt": "hi"}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        router.client("wrong").completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_an_unreachable_decode_server_is_a_502_naming_it(prefill, stack):
    broken = stack[3]
    decode_url = broken.log.read_text().split("decode ")[-1].split()[0]  # the router's banner names it
    with PrefillCount(prefill, 1):  # the prefill ran: the failure is the decode server's
        with pytest.raises(openai.APIStatusError) as e:
            client(broken).completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert e.value.status_code == 502
    error = e.value.body
    assert error["code"] == "decode_unreachable" and error["type"] == "server_error"
    assert error["message"].startswith(f"the decode server at {decode_url} is unreachable"), error
    health = httpx.get(f"{broken.url}/health")
    assert health.status_code == 503 and health.json()["error"]["message"].startswith(
        f"the decode server at {decode_url} is unreachable")


def test_a_client_leaving_mid_stream_closes_the_decode_stream(decode, router):
    before = decode.metrics()
    body = {"model": MODEL, "prompt": "Leave me", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    # Leaving the block closed the connection to the router, and the router its own to the decode server.
    wait_for(lambda: decode.metrics().get(ABORTED, 0) == before.get(ABORTED, 0) + 1)
    wait_for(lambda: decode.metrics()["modserve_kv_blocks_used"] == 0)
    assert decode.metrics()[GENERATED] - before[GENERATED] < 240


# -- the end ---------------------------------------------------------------------------------------


def test_sigterm_stops_the_routers_cleanly(stack):
    for r in stack[2:]:
        assert stop(r) in (0, -signal.SIGTERM)
        log = r.log.read_text()
        assert "Application shutdown complete" in log and "Traceback" not in log, log
