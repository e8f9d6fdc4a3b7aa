"""How long the disaggregation router waits on its upstreams (``modserve router`` flags).

Kept free of heavy imports: the CLI reads the defaults when it builds its parser."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds; ``read`` None waits forever. docs/disaggregation.md gives the defaults' reasons."""

    connect: float = 5.0  # a server that does not accept in this long is down or its backlog full
    read: float | None = 300.0  # the longest an upstream may stay silent: a whole non-streamed answer
    health: float = 5.0  # each upstream's /health, and each /metrics scrape
    health_ttl: float = 2.0  # how long each server's /health answer is trusted

    def client(self) -> Any:
        """The requests' ``httpx.Timeout``: no pool wait, the router's pool has no limit."""
        import httpx

        return httpx.Timeout(connect=self.connect, read=self.read, write=self.read, pool=None)
