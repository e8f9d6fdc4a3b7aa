"""Which of several servers of one role (prefill or decode) the router sends a request to: the
one with the fewest requests outstanding through this router, ties taken in turn.

The router counts only its own requests: a server's queue from other clients, or how long its
requests are, is not seen.

With a prefix score per server (``acquire_prefix``: the prompt's leading blocks each holds, from
its KV events), the request goes to the best-scoring server among those fewer than ``slack``
requests busier than the least loaded; ties by load, then in turn. No server holds any of it:
by load alone, as without scores."""

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

    def acquire_prefix(self, usable: Sequence[bool], matched: Sequence[int], slack: int) -> tuple[Upstream | None, str]:
        """(the upstream, ``prefix`` or ``load``): the usable upstream holding the most of the
        prompt (``matched``: leading blocks, per upstream) among those under ``slack`` requests
        busier than the least loaded usable one, counted as one request busier."""
        n = len(self.upstreams)
        candidates = [i for i in range(n) if usable[i]]
        if not candidates:
            return None, "load"
        least = min(self.outstanding[i] for i in candidates)
        near = [i for i in candidates if self.outstanding[i] - least < slack]
        best = max(matched[i] for i in near)
        if best == 0:
            return self.acquire(usable), "load"
        i = min((i for i in near if matched[i] == best), key=lambda i: (self.outstanding[i], (i - self.turn) % n))
        self.turn = (i + 1) % n
        self._add(i, 1)
        return self.upstreams[i], "prefix"

    def release(self, upstream: Upstream) -> None:
        self._add(self.upstreams.index(upstream), -1)

    def _add(self, i: int, delta: int) -> None:
        self.outstanding[i] += delta
        self.on_change(self.upstreams[i], self.outstanding[i])
