"""`modserve router` end to end: two real `modserve serve` processes (prefill and decode) on the
tiny checkpoint, the router as a real process in front of them, driven by the official openai
client (httpx where the raw bytes or headers matter).

Without a KV connector the decode server computes the prompt again; what is checked here is the
router's part: the prefill server gets each request once with max_tokens=1 (its /metrics count
one generated token and one finished request per client request), the client gets exactly what
the decode server alone would answer, errors pass through in OpenAI's shape; and each failure
of an upstream (refused, SIGSTOPped, killed with -9 mid-stream) is an OpenAI-shaped answer
naming it within the router's timeouts, costing the other server nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
from server_process import Server, free_port, launch, stop, wait_for, wait_healthy

from modserve.server.router_balance import Balancer
from modserve.server.router_upstreams import CachedHealth, Upstream

MODEL = "tiny-llama"
KEY = "router-key"
GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})
GENERATED = "modserve_generation_tokens_total"
FINISHED = "modserve_requests_finished_total{finish_reason=length}"
ABORTED = "modserve_requests_finished_total{finish_reason=abort}"


def launch_router(tmp: Path, name: str, prefill: str, decode: str, *flags: str) -> Server:
    port = free_port()
    log = tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "modserve", "--log-level", "info", "router", "--prefill", prefill,
           "--decode", decode, "--port", str(port), *flags]
    with open(log, "w") as f:  # a file, not a pipe: a full pipe would stall the router
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=os.environ.copy())
    return Server(proc, f"http://127.0.0.1:{port}", log)


def wait_listening(server: Server, timeout: float = 120) -> None:
    """Any answer will do: a router before a dead server is up but not healthy. (Several routers
    start at once, each importing fastapi and httpx: on a loaded machine that can take a minute.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, f"router exited ({server.proc.returncode}):\n{server.log.read_text()}"
        try:
            httpx.get(f"{server.url}/v1/models", timeout=5)
            return
        except httpx.TransportError:
            time.sleep(0.2)
    raise TimeoutError(f"router not listening after {timeout} s:\n{server.log.read_text()}")


class DeadPort:
    """A port bound and never listened on: connecting is refused, and no other process takes it meanwhile."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"


# The strict router's: short enough to wait out in a test, long enough for a loaded machine's answers.
STRICT = ("--connect-timeout", "2", "--read-timeout", "4", "--health-timeout", "1", "--health-ttl", "0")


class FakeDecode:
    """A decode server in a thread of the test: /health 200, a canned completion, and a stream
    that sends one event and then holds until ``release`` is set. ``asked``: its completions."""

    TEXT = "fake"

    def __init__(self) -> None:
        self.asked: list[dict] = []
        self.release = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.answer(200 if self.path == "/health" else 404, b"{}")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                fake.asked.append(body)
                if not body.get("stream"):
                    choice = {"index": 0, "text": FakeDecode.TEXT, "finish_reason": "length", "logprobs": None}
                    return self.answer(200, json.dumps({"id": "fake", "object": "text_completion", "model": MODEL,
                                                        "choices": [choice]}).encode())
                self.send_response(200)  # HTTP/1.0: the stream ends with the connection
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                event = {"id": "fake", "object": "text_completion", "choices": [{"index": 0, "text": "f"}]}
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.wfile.flush()
                fake.release.wait(60)
                self.wfile.write(b"data: [DONE]\n\n")

            def answer(self, status: int, content: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture(scope="module")
def fake_decode():
    fake = FakeDecode()
    yield fake
    fake.close()


def kv_events(ports: tuple[int, int]) -> list[str]:
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{ports[0]}",
              "replay_endpoint": f"tcp://*:{ports[1]}"}
    return ["--kv-events-config", json.dumps(config)]


def events_of(server: Server, ports: tuple[int, int]) -> list[str]:
    return ["--prefill-kv-events", f"{server.url}=tcp://127.0.0.1:{ports[0]},tcp://127.0.0.1:{ports[1]}"]


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory, fake_decode):
    """prefill server, decode server, the router in front of them, a router whose decode server
    is a port nobody listens on, one whose prefill server is, one with short timeouts, one in
    front of two prefill servers (the real one and a port nobody listens on) and three decode
    servers: the fake, the real one and a port nobody listens on; and one that routes by prefix
    in front of two prefill servers, the real ones (their KV events on), and a fake decode server."""
    tmp = tmp_path_factory.mktemp("router")
    common = ["--model", llama_dir, "--served-model-name", MODEL, "--num-kv-blocks", "128",
              "--max-model-len", "256", "--num-threads", "1"]
    key = {"MODSERVE_API_KEY": KEY}  # both servers want it: the router must forward it
    ports = [(free_port(), free_port()) for _ in range(2)]
    prefill = launch(tmp, "prefill", *common, *kv_events(ports[0]), env=key)
    decode = launch(tmp, "decode", *common, *kv_events(ports[1]), env=key)
    quiet = FakeDecode()
    routers: list[Server] = []
    dead = DeadPort()
    try:
        wait_healthy(prefill)
        wait_healthy(decode)
        routers.append(launch_router(tmp, "router", prefill.url, decode.url))
        routers.append(launch_router(tmp, "no-decode", prefill.url, dead.url))
        routers.append(launch_router(tmp, "no-prefill", dead.url, decode.url))
        routers.append(launch_router(tmp, "strict", prefill.url, decode.url, *STRICT))
        routers.append(launch_router(tmp, "several", prefill.url, fake_decode.url, "--decode", decode.url,
                                     "--decode", dead.url, "--prefill", dead.url, "--health-ttl", "60"))
        routers.append(launch_router(tmp, "prefix", prefill.url, quiet.url, "--prefill", decode.url,
                                     *events_of(prefill, ports[0]), *events_of(decode, ports[1]),
                                     "--tokenizer", llama_dir, "--health-ttl", "60", "--health-timeout", "1"))
        for r in routers:
            wait_listening(r)
        yield prefill, decode, *routers
    finally:
        for s in (*routers, prefill, decode):
            stop(s)
        dead.sock.close()
        quiet.close()


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


def banner_url(router: Server, role: str) -> str:
    return router.log.read_text().split(f"{role} ")[-1].split(",")[0].split()[0]  # "routing: prefill X, decode Y"


def error_of(router: Server, **body) -> tuple[httpx.Response, dict, float]:
    start = time.monotonic()
    r = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    return r, r.json()["error"], time.monotonic() - start


def test_a_down_decode_server_is_a_503_naming_it_and_costs_no_prefill(prefill, stack):
    broken = stack[3]
    decode_url = banner_url(broken, "decode")
    with PrefillCount(prefill, 0):  # checked before the prefill: none was spent
        r, error, took = error_of(broken)
        with pytest.raises(openai.APIStatusError) as e:
            client(broken).completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert r.status_code == e.value.status_code == 503 and took < 3, (r.status_code, took)
    assert error["code"] == "decode_unavailable" and error["type"] == "server_error" and e.value.body == error
    assert error["message"].startswith(f"the decode server at {decode_url} is unreachable"), error
    assert r.headers["retry-after"] == "2" and r.headers["x-modserve-upstream"] == "decode"
    health = httpx.get(f"{broken.url}/health")
    assert health.status_code == 503 and health.json()["error"]["message"].startswith(
        f"the decode server at {decode_url} is unreachable")


def test_the_decode_servers_health_is_asked_once_per_ttl_by_a_burst():
    """In-process: the cache the router asks before each prefill (no servers needed)."""
    asked = []

    async def check() -> str | None:
        asked.append(1)
        await asyncio.sleep(0.05)
        return "down" if len(asked) > 1 else None

    async def burst() -> list:
        health = CachedHealth(check, ttl=60)
        first = await asyncio.gather(*(health.get() for _ in range(5)))
        cached = await health.get()
        health.forget()  # a failed request: the next one asks afresh
        return [*first, cached, await health.get()]

    assert asyncio.run(burst()) == [None] * 6 + ["down"] and len(asked) == 2


def finished(server: Server) -> float:
    return server.metrics().get(FINISHED, 0)


def test_a_down_prefill_server_is_a_503_naming_it_and_never_decoded(decode, stack):
    broken = stack[4]
    prefill_url = banner_url(broken, "prefill")
    before = finished(decode)
    r, error, took = error_of(broken)
    assert r.status_code == 503 and error["code"] == "prefill_unavailable" and took < 3, (r.status_code, error, took)
    assert error["message"].startswith(f"the prefill server at {prefill_url} is unreachable"), error
    assert error["message"].endswith("; the request was not sent to any server"), error
    assert r.headers["x-modserve-upstream"] == "prefill" and r.headers["retry-after"] == "2"
    assert finished(decode) == before


@contextlib.contextmanager
def frozen(server: Server):
    """``server`` SIGSTOPped for the block; after SIGCONT, the requests it took meanwhile are done."""
    server.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        server.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: server.metrics()["modserve_num_requests_running"] == 0
             and server.metrics()["modserve_num_requests_waiting"] == 0)


def test_a_frozen_decode_server_is_a_503_and_costs_no_prefill(prefill, decode, stack):
    strict = stack[5]
    with PrefillCount(prefill, 0), frozen(decode):
        r, error, took = error_of(strict)
    assert r.status_code == 503 and error["code"] == "decode_unavailable" and took < 1 + 1, (r.status_code, took)
    assert error["message"].startswith(f"the decode server at {decode.url} did not answer /health within "
                                       "--health-timeout 1 s"), error


def test_the_router_metrics_hold_both_servers_and_its_own(prefill, decode, router):
    client(router).completions.create(model=MODEL, prompt="Count me", **GREEDY)
    mine = router.metrics()
    for role, server in (("prefill", prefill), ("decode", decode)):
        theirs = server.metrics()
        for name in (GENERATED, "modserve_kv_blocks_total", "modserve_e2e_request_latency_seconds_count"):
            assert mine[f"{name}{{role={role},upstream={server.url}}}"] == theirs[name], (role, name)
        assert mine[f"modserve_disagg_upstream_up{{role={role},upstream={server.url}}}"] == 1
    assert mine["modserve_disagg_requests_total{path=/v1/completions}"] >= 1
    assert mine["modserve_disagg_prefill_seconds_count"] >= 1
    text = httpx.get(f"{router.url}/metrics").text
    assert text.count(f"# TYPE {GENERATED} counter") == 1  # one family, both servers


def test_a_frozen_prefill_server_fails_health_and_requests_within_their_timeouts(prefill, decode, stack):
    """--health-timeout 1, --health-ttl 0: /health and a request answer in time, naming the flag;
    the request is a 503 from the prefill server's /health, asked before it is sent."""
    strict = stack[5]
    before = finished(decode)
    with frozen(prefill):
        start = time.monotonic()
        health = httpx.get(f"{strict.url}/health", timeout=30)
        health_s = time.monotonic() - start
        r, error, took = error_of(strict)
    assert health.status_code == 503 and health_s < 1 + 1, (health.status_code, health_s)
    assert health.json()["error"]["message"] == (
        f"the prefill server at {prefill.url} did not answer /health within --health-timeout 1 s (ReadTimeout)"
    ), health.json()
    assert r.status_code == 503 and error["code"] == "prefill_unavailable" and took < 1 + 1, (r.status_code, took)
    assert error["message"] == (f"the prefill server at {prefill.url} did not answer /health within --health-timeout "
                                "1 s (ReadTimeout); the request was not sent to any server")
    assert finished(decode) == before  # nothing went to the decode server


# -- several decode servers ------------------------------------------------------------------------


def test_the_least_loaded_usable_upstream_is_picked_ties_in_turn():
    """In-process: the balancer's choices, and the gauge it keeps."""
    a, b, c = (Upstream("decode", f"http://{n}:1") for n in "abc")
    gauge: dict[str, int] = {}
    pool = Balancer([a, b, c], lambda u, n: gauge.__setitem__(u.url, n))
    assert [pool.acquire() for _ in range(4)] == [a, b, c, a]  # all idle, then a ahead
    pool.release(b)
    assert pool.acquire() == b  # the least loaded, though c's turn
    for u in (a, a, b, c):
        pool.release(u)
    assert pool.acquire([False, True, True]) == c and pool.acquire([False, True, True]) == b  # a left out
    assert pool.acquire([False, False, False]) is None
    assert gauge == {a.url: 0, b.url: 1, c.url: 1} and pool.outstanding == [0, 1, 1]


def routed(router: Server, prompt: str, **body) -> httpx.Response:
    r = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": prompt, **GREEDY_BODY, **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r


GREEDY_BODY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
OUTSTANDING = "modserve_disagg_upstream_outstanding_requests"


def test_requests_go_to_the_least_loaded_healthy_decode_server(prefill, decode, fake_decode, stack):
    """Decode servers: the fake (first), the real one, a dead port. A stream held open on the fake
    sends the next two requests to the real one: by load (in turn the second would go to the
    dead port, or past it to the fake); the dead port is never asked. The real pair's text is the
    decode server's alone."""
    several = stack[6]
    dead_prefill = several.log.read_text().split("routing: prefill ")[1].split(",")[0].split()[1]
    alone = [client(decode).completions.create(model=MODEL, prompt=p, **GREEDY).choices[0].text
             for p in ("Spread me", "And me")]
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "Hold me", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{several.url}/v1/completions", json=body, headers=headers, timeout=60) as held:
        assert held.headers["x-modserve-upstream-url"] == fake_decode.url
        lines = held.iter_lines()
        assert next(lines).startswith("data: {")
        answers = [routed(several, p) for p in ("Spread me", "And me")]
        assert [a.headers["x-modserve-upstream-url"] for a in answers] == [decode.url] * 2
        assert [a.headers["x-modserve-prefill-url"] for a in answers] == [prefill.url] * 2  # the dead one skipped
        assert [a.json()["choices"][0]["text"] for a in answers] == alone
        mine = several.metrics()
        assert mine[f"{OUTSTANDING}{{role=decode,upstream={fake_decode.url}}}"] == 1
        assert mine[f"{OUTSTANDING}{{role=decode,upstream={decode.url}}}"] == 0
        health = httpx.get(f"{several.url}/health", timeout=30)
        fake_decode.release.set()
        assert [line for line in lines if line.startswith("data:")] == ["data: [DONE]"]
    assert [b["prompt"] for b in fake_decode.asked] == ["Hold me"]
    wait_for(lambda: several.metrics()[f"{OUTSTANDING}{{role=decode,upstream={fake_decode.url}}}"] == 0)
    dead_url = several.log.read_text().split("routing: ")[1].splitlines()[0].split()[-1]  # "... decode F D DEAD"
    assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
    listed = {(u["role"], u["url"]): u for u in health.json()["upstreams"]}
    assert [(u["healthy"], u["outstanding_requests"]) for u in listed.values()] == [
        (True, 0), (False, 0), (True, 1), (True, 0), (False, 0)], listed
    assert listed["prefill", dead_prefill]["problem"].startswith(f"the prefill server at {dead_prefill} is unreachable")
    assert listed["decode", dead_url]["problem"].startswith(f"the decode server at {dead_url} is unreachable")
    assert several.metrics()[f"{OUTSTANDING}{{role=prefill,upstream={prefill.url}}}"] == 0


# -- prefix-aware routing of prefill requests -----------------------------------------------------

BLOCK = 16  # the servers' --block-size (the default)
# About 110 tokens: 6 full blocks or more shared by every prompt that starts with it.
PREFIX = ("The lighthouse keeper counted the ships that passed each night, writing their names, flags and "
          "cargo into a ledger bound in green leather, while the fog rolled over the rocks below and the gulls "
          "slept on the railings of the tower until the morning bell rang from the harbour.")
EVENT_BLOCKS = "modserve_disagg_kv_event_blocks_total"
EVICTIONS = "modserve_prefix_cache_evictions_total"


def event_blocks(router: Server, server: Server, event: str) -> float:
    return router.metrics().get(f"{EVENT_BLOCKS}{{event={event},role=prefill,upstream={server.url}}}", 0)


def shared_blocks(server: Server, first: str, *others: str) -> int:
    """Full blocks ``first`` has in common with each of ``others``, by the server's tokenizer."""
    def tokens(prompt: str) -> list[int]:
        return httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": prompt},
                          headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]

    mine = tokens(first)
    return min(next((i for i, (a, b) in enumerate(zip(mine, tokens(o))) if a != b), len(mine))
               for o in others) // BLOCK


def test_a_prompt_goes_to_the_prefill_server_holding_its_prefix(prefill, decode, stack):
    """Two real prefill servers with their KV events on (the stack's two), a fake decode server. A
    prompt's prefix, once one server cached it, sends the next prompts that share it there, though
    that server is frozen with one of them outstanding and the other idle; that server's prefix
    cache hits say they were hits. Once the server evicted those blocks (its BlockRemoved events),
    the prefix sends nothing there any more."""
    router = stack[7]
    servers = {s.url: s for s in (prefill, decode)}
    nights = [f"{PREFIX} {n} night." for n in ("First", "Second", "Third", "Fourth")]
    shared = shared_blocks(prefill, *nights)
    assert shared >= 6, shared
    before = {url: event_blocks(router, s, "stored") for url, s in servers.items()}
    first = routed(router, nights[0])
    holder = servers[first.headers["x-modserve-prefill-url"]]
    other = next(s for s in servers.values() if s is not holder)
    assert first.headers["x-modserve-prefix-blocks"] == "0"
    wait_for(lambda: event_blocks(router, holder, "stored") - before[holder.url] >= shared)

    hits = holder.metrics()["modserve_prefix_cache_hit_tokens_total"]
    mine = router.metrics()
    with ThreadPoolExecutor(2) as pool:
        with frozen(holder):
            held = [pool.submit(routed, router, nights[1])]
            wait_for(lambda: router.metrics()[f"{OUTSTANDING}{{role=prefill,upstream={holder.url}}}"] == 1)
            held.append(pool.submit(routed, router, nights[2]))  # 1 outstanding there, 0 on the other
            wait_for(lambda: router.metrics()[f"{OUTSTANDING}{{role=prefill,upstream={holder.url}}}"] == 2)
            elsewhere = routed(router, "Something else entirely.")  # no prefix: by load
        answers = [h.result() for h in held]
    assert elsewhere.headers["x-modserve-prefill-url"] == other.url
    assert [(a.headers["x-modserve-prefill-url"], a.headers["x-modserve-prefix-blocks"]) for a in answers] == [
        (holder.url, str(shared))] * 2
    wait_for(lambda: holder.metrics()["modserve_prefix_cache_hit_tokens_total"] - hits >= 2 * shared * BLOCK)
    routed_by = router.metrics()
    key = f"modserve_disagg_routed_requests_total{{by=prefix,role=prefill,upstream={holder.url}}}"
    assert routed_by[key] - mine.get(key, 0) == 2

    # A chat prompt is hashed through the chat template, as the server tokenizes it.
    def chat(question: str) -> httpx.Response:
        messages = [{"role": "system", "content": PREFIX}, {"role": "user", "content": question}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 4}
        r = httpx.post(f"{router.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=60)
        assert r.status_code == 200, r.text
        return r

    stored = {url: event_blocks(router, s, "stored") for url, s in servers.items()}
    asked = chat("Which ship came first?")
    chat_holder = servers[asked.headers["x-modserve-prefill-url"]]
    wait_for(lambda: event_blocks(router, chat_holder, "stored") - stored[chat_holder.url] >= shared)
    again = chat("And which came last?")
    assert again.headers["x-modserve-prefill-url"] == chat_holder.url
    assert int(again.headers["x-modserve-prefix-blocks"]) >= shared

    # Evicted: prompts of their own, sent to the holder directly, fill its 128 blocks over and over.
    removed, evictions = event_blocks(router, holder, "removed"), holder.metrics()[EVICTIONS]
    for i in range(14):  # 11 blocks each
        words = " ".join(f"{w}{i}" for w in ("ledger", "harbour", "gull", "tower", "fog", "bell") * 8)
        holder.client(KEY).completions.create(model=MODEL, prompt=words, max_tokens=1)
    wait_for(lambda: event_blocks(router, holder, "removed") - removed == holder.metrics()[EVICTIONS] - evictions > 0)
    gone = routed(router, nights[3])
    assert gone.headers["x-modserve-prefix-blocks"] == "0", gone.headers


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


def test_a_decode_server_killed_mid_stream_ends_it_with_an_error_event(decode, router):
    """Kills the decode server: after every other test that asks it. The client gets whole events,
    an OpenAI-shaped error event naming the decode server, then [DONE]; the router logs one
    warning and no traceback, and turns the next request away before its prefill."""
    body = {"model": MODEL, "prompt": "Die", "max_tokens": 240, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data:"))
        events += [next(lines) for _ in range(3)]
        os.kill(decode.proc.pid, signal.SIGKILL)
        decode.proc.wait()
        events += list(lines)
    assert events[-1] == "data: [DONE]" and len(events) < 240, events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "decode_unreachable" and error["type"] == "server_error", error
    assert error["message"].startswith(f"the decode server at {decode.url} dropped the connection"), error
    assert all(json.loads(e.removeprefix("data: "))["choices"] for e in events[:-2])  # no half event
    wait_for(lambda: "failed mid-stream" in router.log.read_text())
    log = router.log.read_text()
    assert log.count("failed mid-stream") == 1 and "WARNING" in log.split("failed mid-stream")[0].splitlines()[-1]
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    assert router.metrics()["modserve_disagg_upstream_errors_total{kind=disconnected,role=decode}"] == 1
    with pytest.raises(openai.APIStatusError) as e:
        client(router).completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert e.value.status_code == 503 and e.value.body["code"] == "decode_unavailable"


# -- the end ---------------------------------------------------------------------------------------


def test_sigterm_stops_the_routers_cleanly(stack):
    for r in stack[2:]:
        assert stop(r) in (0, -signal.SIGTERM)
        log = r.log.read_text()
        assert "Application shutdown complete" in log and "Traceback" not in log, log
