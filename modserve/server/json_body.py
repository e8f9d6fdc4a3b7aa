"""Request bodies parsed as JSON that says one thing: a key given twice in one object is a 400.

``json.loads`` keeps the last of two ``"temperature"`` keys, another parser (a proxy, a
logger, a filter in front) may keep the first: the server would run a request other
than the one checked. FastAPI parses each body once, through :class:`JSONRequest`, so
the check costs one pass no longer than the body limit allows.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Coroutine

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response


class DuplicateKey(json.JSONDecodeError):
    """A JSON decode error (FastAPI turns it into a validation error) that names the key."""

    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}", "", 0)
        self.key = key


def loads(text: str | bytes) -> Any:
    """``json.loads`` that refuses a key given twice in one object."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen: set[str] = set()
            raise DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
        return obj

    return json.loads(text, object_pairs_hook=unique)


class JSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class JSONRoute(APIRoute):
    """A route whose body is parsed by :func:`loads`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parse_strictly(request: Request) -> Response:
            return await handler(JSONRequest(request.scope, request.receive))

        return parse_strictly
