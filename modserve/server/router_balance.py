"""Which of several servers of one role (prefill or decode) the router sends a request to: the
one with the fewest requests outstanding through this router, ties taken in turn.

The router counts only its own requests: a server's queue from other clients, or how long its
requests are, is not seen. Prefix-aware routing (by the engines' KV events) is not done."""

from __future__ import annotations

from typing import Callable, Sequence

from modserve.server.router_upstreams import Upstream


class Balancer:
    """``upstreams`` of one role, each with its requests outstanding.

    NOTE: ``acquire`` picks and counts in one step with no await between, so concurrent requests
    on the event loop each see the others' picks.
    """

    def __init__(self, upstreams: Sequence[Upstream], on_change: Callable[[Upstream, int], None]) -> None:
        assert upstreams, "a role needs at least one server"
        self.upstreams = list(upstreams)
        self.outstanding = [0] * len(upstreams)
        self.on_change = on_change
        self.turn = 0  # where the round robin among ties starts next
        for u in self.upstreams:
            on_change(u, 0)

    def acquire(self, usable: Sequence[bool] | None = None) -> Upstream | None:
        """The least loaded usable upstream, counted as one request busier; None if none is usable."""
        n = len(self.upstreams)
        candidates = [i for i in range(n) if usable is None or usable[i]]
        if not candidates:
            return None
        least = min(self.outstanding[i] for i in candidates)
        i = min((i for i in candidates if self.outstanding[i] == least), key=lambda i: (i - self.turn) % n)
        self.turn = (i + 1) % n
        self._add(i, 1)
        return self.upstreams[i]

    def release(self, upstream: Upstream) -> None:
        self._add(self.upstreams.index(upstream), -1)

    def _add(self, i: int, delta: int) -> None:
        self.outstanding[i] += delta
        self.on_change(self.upstreams[i], self.outstanding[i])
