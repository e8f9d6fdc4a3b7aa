"""Requests whose headers two readers could read two ways are refused, not guessed at.

- ``Content-Length`` with ``Transfer-Encoding``: a proxy in front may frame the body by
  one header and this server (h11) by the other, so what one takes for body the other
  serves as a second request (request smuggling). 400 with ``Connection: close``: the
  connection ends with the answer and nothing pipelined behind it is read.
- More than one ``Authorization``: a proxy may check one key and the API-key check read
  another. 400.

The outermost middleware: it runs before the body is read or the key is checked.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from modserve.server.errors import APIError


class HTTPHygieneMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = refusal(scope["headers"])
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def refusal(headers: list[tuple[bytes, bytes]]) -> APIError | None:
    names = [name.lower() for name, _ in headers]
    if b"transfer-encoding" in names and b"content-length" in names:
        return APIError(400, "a request may carry Content-Length or Transfer-Encoding, not both",
                        param="transfer-encoding", code="ambiguous_request", headers={"Connection": "close"})
    if names.count(b"authorization") > 1:
        return APIError(400, f"{names.count(b'authorization')} Authorization headers; send exactly one",
                        param="authorization", code="ambiguous_request")
    return None
