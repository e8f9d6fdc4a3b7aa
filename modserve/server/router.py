"""The disaggregated-serving router: an OpenAI-compatible front for prefill servers (the KV
producers) and decode servers (the KV consumers), as vLLM's disaggregated-prefill proxy does it.

Each completion is sent twice: first to the prefill server with ``max_tokens=1`` (it computes
the prompt's KV, which its KV connector hands on), then, once that has answered, to the decode
server, whose answer the client gets, streamed event by event when it asked for a stream. A
prefill answer that carries vLLM's ``kv_transfer_params`` (where the KV is) has them put on the
decode request; without them the decode server finds the KV by content. The decode server's
health, and the prefill servers', are checked (cached briefly) before a prefill is spent. With
several servers of a role, each request goes to the one with the fewest requests outstanding
through this router (``router_balance``), servers that fail /health left out; with the prefill
servers' KV events followed (``router_prefix``), a prefill request goes to the server that holds
the longest cached prefix of its prompt unless that one is much busier. docs/disaggregation.md
has the commands that start the processes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from modserve.server.errors import APIError
from modserve.server.router_balance import Balancer
from modserve.server.router_metrics import RouterMetrics
from modserve.server.router_timeouts import Timeouts
from modserve.server.router_upstreams import (CachedHealth, Upstream, decode_down, failure_kind,
                                              health_problem, prefill_down, unreachable)

if TYPE_CHECKING:  # imported when prefix routing is asked for: the tokenizer's imports take seconds
    from modserve.server.router_prefix import PrefixIndex, PrefixRouting
    from modserve.server.router_prompt import PromptTokenizer

logger = logging.getLogger("modserve.router")

# Only these go upstream: hop-by-hop headers (host, content-length, connection) must not.
FORWARDED_HEADERS = ("authorization", "content-type", "accept")
# And these come back with an upstream's answer: a 503's retry-after, a 401's challenge.
RETURNED_HEADERS = ("retry-after", "www-authenticate")
REQUEST_ID_HEADER = "x-request-id"
PREFILL_MS_HEADER = "x-modserve-prefill-ms"
DECODE_HEADERS_MS_HEADER = "x-modserve-decode-headers-ms"
UPSTREAM_URL_HEADER = "x-modserve-upstream-url"  # which server of its role answered
PREFILL_URL_HEADER = "x-modserve-prefill-url"  # which prefill server the decode answer followed
PREFIX_BLOCKS_HEADER = "x-modserve-prefix-blocks"  # leading prompt blocks the chosen prefill server held
KV_PARAMS = "kv_transfer_params"
# The prefill server's 400 to do_remote_decode when its connector keeps no KV for a decode server.
NO_PARAMS_PARAM = f"{KV_PARAMS}.do_remote_decode"
SSE_DONE = b"data: [DONE]\n\n"


def prefill_body(body: dict[str, Any], params: bool) -> dict[str, Any]:
    """The request the prefill server gets: one token, one sample, no stream. Its only job is
    the prompt's KV; the decode server generates everything the client sees. ``params``: ask
    it, as vLLM's proxy does, to keep the KV for a decode server and say where in its answer."""
    # stream_options: refused without a stream; the client's own kv_transfer_params: the router pairs the two
    out = {k: v for k, v in body.items() if k not in ("stream_options", KV_PARAMS)}
    out.update(max_tokens=1, stream=False, n=1)
    if params:
        out[KV_PARAMS] = {"do_remote_decode": True}
    if "max_completion_tokens" in out:  # chat's newer spelling wins over max_tokens on the server
        out["max_completion_tokens"] = 1
    return out


def passthrough(resp: httpx.Response, upstream: Upstream, headers: dict[str, str] | None = None) -> Response:
    """An upstream's whole answer, status and body as they are (an OpenAI error stays one)."""
    extra = {k: v for k, v in resp.headers.items() if k in RETURNED_HEADERS}
    extra.update({"x-modserve-upstream": upstream.role, UPSTREAM_URL_HEADER: upstream.url, **(headers or {})})
    return Response(resp.content, status_code=resp.status_code, headers=extra,
                    media_type=resp.headers.get("content-type"))


def transfer_params(resp: httpx.Response) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill answer, None if it has none."""
    try:
        params = resp.json().get(KV_PARAMS)
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) else None


def refuses_params(resp: httpx.Response) -> bool:
    """Whether a prefill answer is the 400 of a server whose connector keeps no KV for a decode
    server (no connector, or a consumer's): it takes requests, but not do_remote_decode."""
    if resp.status_code != 400:
        return False
    try:
        return resp.json()["error"]["param"] == NO_PARAMS_PARAM
    except (ValueError, KeyError, TypeError):
        return False


class RelayedStream(StreamingResponse):
    """The decode server's SSE stream, relayed event by event as it arrives.

    Only whole events go out (a chunk's unfinished tail waits for the rest), so a decode server
    that fails mid-stream leaves no half event before the error event and ``[DONE]`` the client
    gets instead of a broken connection.

    NOTE: the upstream stream is closed in ``__call__``'s finally whatever ends the relay (its
    end, the client going away, a cancellation), shielded from the cancellation itself: closing
    the connection mid-body is what tells the decode server to abort the request and free its KV.
    """

    def __init__(self, upstream: httpx.Response, headers: dict[str, str], on_done: Any, on_error: Any) -> None:
        self.upstream = upstream
        self.first_byte: float | None = None
        self.on_done, self.on_error = on_done, on_error
        super().__init__(self._relay(), status_code=upstream.status_code, headers=headers,
                         media_type=upstream.headers.get("content-type", "text/event-stream"))

    async def _relay(self) -> AsyncIterator[bytes]:
        tail = b""
        try:
            async for chunk in self.upstream.aiter_raw():
                if self.first_byte is None:
                    self.first_byte = time.perf_counter()
                tail += chunk
                end = tail.rfind(b"\n\n") + 2
                if end > 1:
                    yield tail[:end]
                    tail = tail[end:]
        except httpx.TransportError as e:  # killed, reset, or silent past the read timeout
            error: APIError = self.on_error(e)
            yield b"data: " + json.dumps(error.body()).encode() + b"\n\n" + SSE_DONE
            return
        if tail:
            yield tail

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
            self.on_done(self.first_byte)


def upstreams_of(role: str, urls: str | Sequence[str]) -> list[Upstream]:
    listed = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
    if not listed or len(set(listed)) < len(listed):
        raise ValueError(f"give each {role} server once, at least one: {listed}")
    return [Upstream(role, u) for u in listed]


def prefix_index(prefix: PrefixRouting, prefills: list[Upstream],
                 metrics: RouterMetrics) -> tuple[PrefixIndex, PromptTokenizer]:
    from modserve.server.router_prefix import EventSource, PrefixIndex
    from modserve.server.router_prompt import PromptTokenizer

    by_url = {u.url: u for u in prefills}
    sources = []
    for url, endpoint, replay in prefix.sources:
        if url.rstrip("/") not in by_url:
            raise ValueError(f"KV events of {url}, which is not a --prefill server ({' '.join(by_url)})")
        sources.append(EventSource(by_url[url.rstrip("/")], endpoint, replay))

    for u in {s.upstream for s in sources}:
        metrics.kv_batch(u, 0, 0, 0)  # each family shows from the start
    return PrefixIndex(sources, metrics), PromptTokenizer(prefix.tokenizer, prefix.chat_template)


def create_router_app(prefill_urls: str | Sequence[str], decode_urls: str | Sequence[str],
                      timeouts: Timeouts = Timeouts(), prefix: PrefixRouting | None = None) -> FastAPI:
    """The router in front of the prefill servers ``prefill_urls`` and the decode servers
    ``decode_urls``; ``prefix``: route prefill requests by the servers' KV events."""
    prefills, decodes = upstreams_of("prefill", prefill_urls), upstreams_of("decode", decode_urls)
    metrics = RouterMetrics()
    index, tokenizer = prefix_index(prefix, prefills, metrics) if prefix is not None else (None, None)

    def gauge(upstream: Upstream, n: int) -> None:
        metrics.outstanding.labels(upstream.role, upstream.url).set(n)

    prefill_pool, decode_pool = Balancer(prefills, gauge), Balancer(decodes, gauge)
    client: httpx.AsyncClient | None = None  # the requests'
    prober: httpx.AsyncClient | None = None  # /health and /metrics': a frozen upstream must not hold them long
    checks = {u: CachedHealth(lambda u=u: health_problem(prober, u, timeouts), timeouts.health_ttl)
              for u in (*prefills, *decodes)}  # each upstream's cached /health
    refusing: set[Upstream] = set()  # prefill servers that refused do_remote_decode

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal client, prober
        # No pool limit: the router must never queue what the servers would take (they
        # refuse with 503 themselves when full, and that answer is passed on).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        client = httpx.AsyncClient(timeout=timeouts.client(), limits=limits)
        prober = httpx.AsyncClient(timeout=timeouts.health, limits=httpx.Limits(max_connections=None))
        logger.info("routing: prefill %s, decode %s", " ".join(u.url for u in prefills),
                    " ".join(u.url for u in decodes))
        if index is not None:
            index.start()
        try:
            yield
        finally:
            if index is not None:
                await index.stop()
                tokenizer.close()
            await client.aclose()
            await prober.aclose()

    app = FastAPI(title="modserve router", lifespan=lifespan)

    def failed(upstream: Upstream, exc: httpx.TransportError) -> APIError:
        metrics.errors.labels(upstream.role, failure_kind(exc)).inc()
        checks[upstream].forget()  # the next request asks it afresh
        return unreachable(upstream, exc, timeouts)

    async def send(upstream: Upstream, method: str, path: str, headers: dict[str, str],
                   body: bytes | None = None, stream: bool = False) -> httpx.Response:
        assert client is not None, "the router's client starts with the app's lifespan"
        request = client.build_request(method, upstream.url + path, headers=headers, content=body)
        try:
            return await client.send(request, stream=stream)
        except httpx.TransportError as e:
            raise failed(upstream, e) from None

    async def prime(prefill: Upstream, path: str, headers: dict[str, str], raw: bytes, body: Any) -> httpx.Response:
        """The prefill request. A body that is not a JSON object goes as it came: its 400 says
        what is wrong in the server's own words, and the decode server is never asked."""
        if not isinstance(body, dict):
            return await send(prefill, "POST", path, headers, raw)
        asked = prefill not in refusing
        resp = await send(prefill, "POST", path, headers, json.dumps(prefill_body(body, asked)).encode())
        if asked and refuses_params(resp):
            refusing.add(prefill)
            logger.info("the prefill server at %s answers no kv_transfer_params (%s): the decode server finds "
                        "the KV by content", prefill.url, resp.json()["error"]["message"])
            resp = await send(prefill, "POST", path, headers, json.dumps(prefill_body(body, False)).encode())
        return resp

    async def route(request: Request, path: str) -> Response:
        start = time.perf_counter()
        metrics.requests.labels(path).inc()
        raw = await request.body()
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        # The same id on both servers: a KV connector may pair the two requests by it.
        rid = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        headers[REQUEST_ID_HEADER] = rid
        checked = await asyncio.gather(*(checks[u].get() for u in (*prefills, *decodes)))
        prefill_problems, problems = checked[:len(prefills)], checked[len(prefills):]
        for role, found, down in (("decode", problems, decode_down), ("prefill", prefill_problems, prefill_down)):
            if all(found):
                metrics.errors.labels(role, "unhealthy").inc()
                problem = "; ".join(found)
                logger.info("%s %s: not routed: %s", path, rid, problem)
                raise down(decodes[0] if role == "decode" else prefills[0], problem, timeouts.health_ttl)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        asked = time.perf_counter()
        usable = [p is None for p in prefill_problems]
        prefill, by, matched = await choose_prefill(path, body, usable)
        metrics.routed.labels("prefill", prefill.url, by).inc()
        try:
            primed = await prime(prefill, path, headers, raw, body)
        finally:
            prefill_pool.release(prefill)
        prefill_ms = (time.perf_counter() - asked) * 1e3
        metrics.prefill.observe(prefill_ms / 1e3)
        timing = {REQUEST_ID_HEADER: rid, PREFILL_MS_HEADER: f"{prefill_ms:.1f}", PREFILL_URL_HEADER: prefill.url}
        if matched is not None:
            timing[PREFIX_BLOCKS_HEADER] = str(matched)
        if not primed.is_success:
            logger.info("%s %s: prefill answered %d in %.1f ms; not sent to decode", path, rid,
                        primed.status_code, prefill_ms)
            return passthrough(primed, prefill, timing)
        params = transfer_params(primed)
        if params is not None:  # where the prefill server keeps the KV, for the decode server's connector
            raw = json.dumps({**body, KV_PARAMS: params}).encode()
        # Any healthy decode server can take it: kv_transfer_params name the producer, and a
        # content-keyed connector finds the KV wherever the pair shares its store.
        decode = decode_pool.acquire([p is None for p in problems])
        assert decode is not None
        metrics.routed.labels("decode", decode.url, "load").inc()
        try:
            return await finish(decode, path, rid, headers, raw, body, timing, start)
        except BaseException:
            decode_pool.release(decode)
            raise

    async def choose_prefill(path: str, body: Any, usable: list[bool]) -> tuple[Upstream, str, int | None]:
        """(the prefill server, why: ``prefix`` or ``load``, the leading prompt blocks it holds or
        None without prefix routing), counted as one request busier. NOTE: the count and the pick
        happen with no await between (the prompt is tokenized before)."""
        if index is None:
            chosen = prefill_pool.acquire(usable)
            assert chosen is not None
            return chosen, "load", None
        prompts = await tokenizer.prompts(path, body)
        model = body.get("model") if isinstance(body, dict) else None
        matched = [index.matched(p, prompts, model) if ok else 0 for p, ok in zip(prefills, usable)]
        chosen, by = prefill_pool.acquire_prefix(usable, matched, prefix.balance_slack)
        assert chosen is not None
        return chosen, by, matched[prefills.index(chosen)]

    async def finish(decode: Upstream, path: str, rid: str, headers: dict[str, str], raw: bytes, body: Any,
                     timing: dict[str, str], start: float) -> Response:
        """The decode request, its answer relayed. ``decode`` is released by ``done``, once."""
        streamed = isinstance(body, dict) and body.get("stream") is True
        sent = time.perf_counter()
        resp = await send(decode, "POST", path, headers, raw, stream=streamed)
        timing[DECODE_HEADERS_MS_HEADER] = f"{(time.perf_counter() - sent) * 1e3:.1f}"

        def done(first_byte: float | None) -> None:
            decode_pool.release(decode)
            first_ms = "none" if first_byte is None else f"{(first_byte - sent) * 1e3:.1f} ms"
            logger.info("%s %s: prefill %s ms at %s, decode %d at %s, first byte %s, total %.1f ms", path, rid,
                        timing[PREFILL_MS_HEADER], timing[PREFILL_URL_HEADER], resp.status_code, decode.url,
                        first_ms, (time.perf_counter() - start) * 1e3)

        def broken(exc: httpx.TransportError) -> APIError:
            logger.warning("%s %s: the decode server at %s failed mid-stream (%r); the client got an error event",
                           path, rid, decode.url, exc)
            return failed(decode, exc)

        if not streamed:
            done(time.perf_counter())  # read whole: its first byte came with its last
            return passthrough(resp, decode, timing)
        if not resp.is_success:  # a refusal is a JSON error, not a stream
            await resp.aread()
            await resp.aclose()
            done(None)
            return passthrough(resp, decode, timing)
        return RelayedStream(resp, {"x-modserve-upstream": decode.role, UPSTREAM_URL_HEADER: decode.url, **timing},
                             done, broken)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await models_of(request, "/v1/models")

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        return await models_of(request, f"/v1/models/{model}")

    async def models_of(request: Request, path: str) -> Response:
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        # the first decode server last seen healthy (the first if none was); not counted as load
        decode = next((d for d in decodes if checks[d].problem is None), decodes[0])
        return passthrough(await send(decode, "GET", path, headers), decode)

    @app.get("/health")
    async def health() -> Response:
        """Every upstream asked afresh, each within the health timeout: 503 unless each role has
        a healthy server; the body lists each upstream."""
        upstreams = [*prefills, *decodes]
        problems = await asyncio.gather(*(health_problem(prober, u, timeouts) for u in upstreams))
        for u, p in zip(upstreams, problems):
            checks[u].store(p)
        if all(problems[:len(prefills)]) or all(problems[len(prefills):]):
            raise APIError(503, "; ".join(p for p in problems if p), type="server_error", code="upstream_unhealthy")
        pools = {"prefill": prefill_pool, "decode": decode_pool}
        listed = [{"role": u.role, "url": u.url, "healthy": p is None, "problem": p,
                   "outstanding_requests": pools[u.role].outstanding[pools[u.role].upstreams.index(u)]}
                  for u, p in zip(upstreams, problems)]
        return JSONResponse({"status": "degraded" if any(problems) else "ok", "upstreams": listed})

    @app.get("/metrics")
    async def scrape(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k == "authorization"}

        async def text(upstream: Upstream) -> str | None:
            try:
                resp = await prober.get(f"{upstream.url}/metrics", headers=headers)
            except httpx.TransportError as e:
                metrics.errors.labels(upstream.role, failure_kind(e)).inc()
                return None
            return resp.text if resp.status_code == 200 else None

        upstreams = [*prefills, *decodes]
        scraped = await asyncio.gather(*(text(u) for u in upstreams))
        return Response(metrics.render(zip(upstreams, scraped)), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code == 404 else str(exc.detail)
        return APIError(exc.status_code, message).response()

    return app
