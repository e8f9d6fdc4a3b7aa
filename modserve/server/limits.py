"""The request body's limits: its size (413 past it) and how long it may take to arrive (408).

A plain ASGI middleware: it reads the whole body before the app sees the request
(no route parses a 100 MB body, no slow client holds a route open), then replays it,
and hands later ``receive`` calls (disconnect detection) to the server untouched.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modserve.server.errors import APIError


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(int(length))(scope, receive, send)  # refused before any of it is read
            return
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                error = APIError(408, f"the request body did not arrive within request_read_timeout="
                                 f"{self.timeout:g} s", code="request_timeout", headers={"Connection": "close"})
                await error.response()(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # the client went away before its body was complete: nothing to answer
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large(size)(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, size: int):
        return APIError(413, f"the request body is {size} bytes or more, over max_request_body_bytes="
                        f"{self.max_bytes}", code="request_too_large", headers={"Connection": "close"}).response()


def default_max_body_bytes(max_model_len: int) -> int:
    """1 MiB, plus 64 bytes per token of context: room for a full-context prompt as JSON
    text (escapes included) or as token ids, and a chat history around it."""
    return 2**20 + 64 * max_model_len
