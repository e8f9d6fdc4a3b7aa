"""The disaggregated-serving router: an OpenAI-compatible front for a prefill server (the KV
producer) and a decode server (the KV consumer), as vLLM's disaggregated-prefill proxy does it.

Each completion is sent twice: first to the prefill server with ``max_tokens=1`` (it computes
the prompt's KV, which its KV connector hands on), then, once that has answered, unchanged to
the decode server, whose answer the client gets, streamed chunk by chunk when it asked for a
stream. docs/disaggregation.md has the commands that start the three processes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from modserve.server.errors import APIError

logger = logging.getLogger("modserve.router")

# Only these go upstream: hop-by-hop headers (host, content-length, connection) must not.
FORWARDED_HEADERS = ("authorization", "content-type", "accept")
# And these come back with an upstream's answer: a 503's retry-after, a 401's challenge.
RETURNED_HEADERS = ("retry-after", "www-authenticate")
REQUEST_ID_HEADER = "x-request-id"
PREFILL_MS_HEADER = "x-modserve-prefill-ms"
DECODE_HEADERS_MS_HEADER = "x-modserve-decode-headers-ms"


@dataclass(frozen=True, slots=True)
class Upstream:
    role: str  # "prefill" or "decode": named in every error about it
    url: str  # http://host:port, no trailing slash


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill server gets: one token, one sample, no stream. Its only job is
    the prompt's KV; the decode server generates everything the client sees."""
    out = {k: v for k, v in body.items() if k != "stream_options"}  # refused without stream
    out.update(max_tokens=1, stream=False, n=1)
    if "max_completion_tokens" in out:  # chat's newer spelling wins over max_tokens on the server
        out["max_completion_tokens"] = 1
    return out


def unreachable(upstream: Upstream, exc: httpx.TransportError) -> APIError:
    what = "did not answer in time" if isinstance(exc, httpx.TimeoutException) else "is unreachable"
    return APIError(504 if isinstance(exc, httpx.TimeoutException) else 502,
                    f"the {upstream.role} server at {upstream.url} {what}: {exc!r}",
                    type="server_error", code=f"{upstream.role}_unreachable",
                    headers={"x-modserve-upstream": upstream.role})


def passthrough(resp: httpx.Response, upstream: Upstream, headers: dict[str, str] | None = None) -> Response:
    """An upstream's whole answer, status and body as they are (an OpenAI error stays one)."""
    extra = {k: v for k, v in resp.headers.items() if k in RETURNED_HEADERS}
    extra.update({"x-modserve-upstream": upstream.role, **(headers or {})})
    return Response(resp.content, status_code=resp.status_code, headers=extra,
                    media_type=resp.headers.get("content-type"))


class RelayedStream(StreamingResponse):
    """The decode server's SSE stream, relayed chunk by chunk as it arrives.

    NOTE: the upstream stream is closed in ``__call__``'s finally whatever ends the relay (its
    end, the client going away, a cancellation), shielded from the cancellation itself: closing
    the connection mid-body is what tells the decode server to abort the request and free its KV.
    """

    def __init__(self, upstream: httpx.Response, headers: dict[str, str], on_done: Any) -> None:
        self.upstream = upstream
        self.first_byte: float | None = None
        self.on_done = on_done
        super().__init__(self._relay(), status_code=upstream.status_code, headers=headers,
                         media_type=upstream.headers.get("content-type", "text/event-stream"))

    async def _relay(self) -> AsyncIterator[bytes]:
        async for chunk in self.upstream.aiter_raw():
            if self.first_byte is None:
                self.first_byte = time.perf_counter()
            yield chunk

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
            self.on_done(self.first_byte)


def create_router_app(prefill_url: str, decode_url: str, timeout: float | None = 3600.0) -> FastAPI:
    """The router in front of ``prefill_url`` and ``decode_url``. ``timeout``: seconds an upstream
    may go silent (connecting takes at most 10 s); None waits forever."""
    prefill, decode = Upstream("prefill", prefill_url.rstrip("/")), Upstream("decode", decode_url.rstrip("/"))
    client: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal client
        # No pool limit: the router must never queue what the servers would take (they
        # refuse with 503 themselves when full, and that answer is passed on).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits)
        logger.info("routing: prefill %s, decode %s", prefill.url, decode.url)
        try:
            yield
        finally:
            await client.aclose()

    app = FastAPI(title="modserve router", lifespan=lifespan)

    async def send(upstream: Upstream, method: str, path: str, headers: dict[str, str],
                   body: bytes | None = None, stream: bool = False) -> httpx.Response:
        assert client is not None, "the router's client starts with the app's lifespan"
        request = client.build_request(method, upstream.url + path, headers=headers, content=body)
        try:
            return await client.send(request, stream=stream)
        except httpx.TransportError as e:
            raise unreachable(upstream, e) from None

    async def route(request: Request, path: str) -> Response:
        start = time.perf_counter()
        raw = await request.body()
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        # The same id on both servers: a KV connector may pair the two requests by it.
        rid = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        headers[REQUEST_ID_HEADER] = rid
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        # A body that is not a JSON object goes to the prefill server as it came: its 400 says
        # what is wrong in the server's own words, and the decode server is never asked.
        first = prefill_body(body) if isinstance(body, dict) else None
        primed = await send(prefill, "POST", path, headers, raw if first is None else json.dumps(first).encode())
        prefill_ms = (time.perf_counter() - start) * 1e3
        timing = {REQUEST_ID_HEADER: rid, PREFILL_MS_HEADER: f"{prefill_ms:.1f}"}
        if not primed.is_success:
            logger.info("%s %s: prefill answered %d in %.1f ms; not sent to decode", path, rid,
                        primed.status_code, prefill_ms)
            return passthrough(primed, prefill, timing)

        streamed = isinstance(body, dict) and body.get("stream") is True
        sent = time.perf_counter()
        resp = await send(decode, "POST", path, headers, raw, stream=streamed)
        timing[DECODE_HEADERS_MS_HEADER] = f"{(time.perf_counter() - sent) * 1e3:.1f}"

        def done(first_byte: float | None) -> None:
            first_ms = "none" if first_byte is None else f"{(first_byte - sent) * 1e3:.1f} ms"
            logger.info("%s %s: prefill %.1f ms, decode %d, first byte %s, total %.1f ms", path, rid, prefill_ms,
                        resp.status_code, first_ms, (time.perf_counter() - start) * 1e3)

        if not streamed:
            done(time.perf_counter())  # read whole: its first byte came with its last
            return passthrough(resp, decode, timing)
        if not resp.is_success:  # a refusal is a JSON error, not a stream
            await resp.aread()
            await resp.aclose()
            done(None)
            return passthrough(resp, decode, timing)
        return RelayedStream(resp, {"x-modserve-upstream": decode.role, **timing}, done)

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
        return passthrough(await send(decode, "GET", path, headers), decode)

    @app.get("/health")
    async def health() -> Response:
        async def check(upstream: Upstream) -> str | None:
            try:
                resp = await send(upstream, "GET", "/health", {})
            except APIError as e:
                return e.message
            return None if resp.status_code == 200 else f"the {upstream.role} server at {upstream.url} " \
                                                         f"answered {resp.status_code}"

        problems = [p for p in await asyncio.gather(check(prefill), check(decode)) if p]
        if problems:
            raise APIError(503, "; ".join(problems), type="server_error", code="upstream_unhealthy")
        return JSONResponse({"status": "ok", "prefill": prefill.url, "decode": decode.url})

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code == 404 else str(exc.detail)
        return APIError(exc.status_code, message).response()

    return app
