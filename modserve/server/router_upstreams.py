"""The disaggregation router's upstream servers: how long each may take, what a failure to reach
one becomes, and whether a prefill and a decode server are up before a prefill is spent."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import httpx

from modserve.server.errors import APIError
from modserve.server.router_timeouts import Timeouts


@dataclass(frozen=True, slots=True)
class Upstream:
    role: str  # "prefill" or "decode": named in every error about it
    url: str  # http://host:port, no trailing slash


def failure_kind(exc: httpx.TransportError) -> str:
    """The ``kind`` label of modserve_disagg_upstream_errors_total."""
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    return "refused" if isinstance(exc, httpx.ConnectError) else "disconnected"


def detail(exc: httpx.TransportError) -> str:
    """httpx's words for ``exc``; a timeout's are empty or just 'timed out'."""
    return type(exc).__name__ if isinstance(exc, httpx.TimeoutException) else repr(exc)


def unreachable(upstream: Upstream, exc: httpx.TransportError, timeouts: Timeouts) -> APIError:
    """502 (refused, reset) or 504 (past a timeout), naming the server and, for a timeout, the flag."""
    if isinstance(exc, httpx.ConnectTimeout):
        what = f"did not accept a connection within --connect-timeout {timeouts.connect:g} s"
    elif isinstance(exc, httpx.TimeoutException):
        what = f"was silent for --read-timeout {timeouts.read:g} s"
    elif isinstance(exc, httpx.ConnectError):
        what = "is unreachable"
    else:  # reset or closed mid-answer (killed, crashed)
        what = "dropped the connection"
    status = 504 if isinstance(exc, httpx.TimeoutException) else 502
    return APIError(status, f"the {upstream.role} server at {upstream.url} {what} ({detail(exc)})", type="server_error",
                    code=f"{upstream.role}_unreachable", headers={"x-modserve-upstream": upstream.role})


async def health_problem(client: httpx.AsyncClient, upstream: Upstream, timeouts: Timeouts) -> str | None:
    """None if ``upstream`` answers /health 200 within the health timeout, else what went wrong."""
    try:
        resp = await client.get(f"{upstream.url}/health", timeout=timeouts.health)
    except httpx.TimeoutException as e:
        return f"the {upstream.role} server at {upstream.url} did not answer /health within " \
               f"--health-timeout {timeouts.health:g} s ({detail(e)})"
    except httpx.TransportError as e:
        return f"the {upstream.role} server at {upstream.url} is unreachable ({detail(e)})"
    if resp.status_code != 200:
        return f"the {upstream.role} server at {upstream.url} answered /health with {resp.status_code}"
    return None


class CachedHealth:
    """One upstream's /health answer, trusted for ``ttl`` seconds.

    NOTE: concurrent callers share one check in flight, shielded from any one caller's
    cancellation: a burst of requests costs the upstream one /health, not one each.
    """

    def __init__(self, check: Callable[[], Awaitable[str | None]], ttl: float) -> None:
        self.check, self.ttl = check, ttl
        self.problem: str | None = None
        self.checked_at = -math.inf
        self.pending: asyncio.Future[str | None] | None = None

    def store(self, problem: str | None) -> None:
        self.problem, self.checked_at = problem, time.monotonic()

    def forget(self) -> None:
        self.checked_at = -math.inf

    async def get(self) -> str | None:
        if time.monotonic() - self.checked_at < self.ttl:
            return self.problem
        if self.pending is None:
            self.pending = asyncio.ensure_future(self._refresh())
        return await asyncio.shield(self.pending)

    async def _refresh(self) -> str | None:
        try:
            self.store(await self.check())
            return self.problem
        finally:
            self.pending = None


def decode_down(decode: Upstream, problem: str, ttl: float) -> APIError:
    return APIError(503, f"{problem}; the request was not sent to the prefill server", type="server_error",
                    code="decode_unavailable",
                    headers={"x-modserve-upstream": decode.role, "retry-after": str(max(1, math.ceil(ttl)))})


def prefill_down(prefill: Upstream, problem: str, ttl: float) -> APIError:
    return APIError(503, f"{problem}; the request was not sent to any server", type="server_error",
                    code="prefill_unavailable",
                    headers={"x-modserve-upstream": prefill.role, "retry-after": str(max(1, math.ceil(ttl)))})
