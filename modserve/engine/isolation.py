"""Culprit isolation: a failed step fails only the request(s) it belongs to.

NOTE: on a failure every sequence drops its KV and keeps its tokens (a recompute
preemption), then each request that was in the scheduler runs alone until it has sampled
again: one that raises alone is the culprit, the others go on together. Greedy outputs are
those of an undisturbed run, as after any recompute preemption.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable, Mapping

from modserve.core.sequence import Sequence, SequenceStatus
from modserve.engine.output import Request
from modserve.engine.scheduler import SchedulerCore

logger = logging.getLogger("modserve")


class CulpritIsolation:
    def __init__(self, scheduler: SchedulerCore, forget: Callable[[Sequence], None]) -> None:
        self.scheduler = scheduler
        self.forget = forget  # a sequence that lost its KV: its proposer state goes too
        self.suspects: deque[str] = deque()  # request ids still to run alone
        self.held: list[Sequence] = []  # kept out of the scheduler meanwhile
        self.probe: str | None = None  # the request running alone now
        self.probe_tokens: dict[Sequence, int] = {}  # its sequences' lengths when it began
        self.active = False
        self.found_culprit = False
        # The last isolation found no culprit and no step has succeeded since: the fault is in
        # the combination of requests, and isolating again would only loop.
        self.cleared_all = False

    def admit(self, seq: Sequence) -> None:
        """A new request's sequence: into the scheduler, or held until the isolation ends."""
        if self.active:
            self.held.append(seq)
        else:
            self.scheduler.add(seq)

    def drop(self, request_id: str) -> None:
        """A request that ended: none of its sequences is held any more."""
        self.held = [s for s in self.held if s.request_id != request_id]

    def before_step(self, requests: Mapping[str, Request]) -> None:
        if self.active and self.probe is None:
            self._next_probe(requests)

    def after_step(self, requests: Mapping[str, Request]) -> None:
        """A step succeeded: a probe that got far enough is cleared, and the next one may run."""
        if not self.active:
            self.cleared_all = False
        if self.probe is not None and self._probe_done(requests.get(self.probe)):
            # Cleared: out again (its KV too), so the next suspect also runs alone.
            self.probe = None
            self.held.extend(self._evict_all())
            if not self.suspects:
                self._end(requests)

    def failed(self, error: Exception, requests: Mapping[str, Request]) -> list[str]:
        """A step raised ``error``: the requests to fail with it (the probe, alone; or every
        one in flight when isolating cannot help), or none while the search starts."""
        if self.probe is not None:  # it failed alone: it is the culprit
            logger.error("request %s failed alone in a step; failing it: %s", self.probe, error, exc_info=error)
            culprit, self.probe, self.found_culprit = self.probe, None, True
            if not self.suspects:
                self._end(requests, skip=culprit)
            return [culprit]
        suspects = self.scheduler.request_ids_in_flight()
        if self.cleared_all:
            # Every suspect ran alone without fault and then failed together again: the fault is
            # in the combination, not in one request; fail the ones in flight rather than loop.
            logger.error("step failed again after isolation found no culprit; failing %d requests",
                         len(suspects), exc_info=error)
            return suspects
        logger.warning("engine step failed (%s: %s); running its %d requests one at a time to find the "
                       "culprit", type(error).__name__, error, len(suspects))
        self.suspects, self.held, self.probe = deque(suspects), self._evict_all(), None
        self.active, self.found_culprit = True, False
        return []

    def _evict_all(self) -> list[Sequence]:
        seqs = self.scheduler.evict_all()
        for seq in seqs:
            self.forget(seq)
        return seqs

    def _next_probe(self, requests: Mapping[str, Request]) -> None:
        """Put the next suspect's sequences alone into the scheduler."""
        while self.suspects:
            rid = self.suspects.popleft()
            mine = [s for s in self.held if s.request_id == rid]
            if rid in requests and mine:
                self.drop(rid)
                for seq in mine:
                    self.scheduler.add(seq)
                self.probe, self.probe_tokens = rid, {s: s.num_tokens for s in mine}
                return
        self._end(requests)

    def _probe_done(self, req: Request | None) -> bool:
        """True once the probed request ran a full step past its old progress, or ended.
        NOTE: two tokens past it: its recompute's prefill makes one, a decode the other (a
        fault of decode steps only, a proposer's, shows only there)."""
        if req is None:
            return True
        live = [s for s in req.seqs if not s.is_finished]
        start = self.probe_tokens
        return all(s.status is SequenceStatus.RUNNING and s.num_computed_tokens == s.num_tokens - 1
                   and not s.pending_forks and s.num_tokens >= start.get(s, 0) + 2 for s in live)

    def _end(self, requests: Mapping[str, Request], skip: str | None = None) -> None:
        for seq in self.held:
            if seq.request_id in requests and seq.request_id != skip:
                self.scheduler.add(seq)
        self.cleared_all = not self.found_culprit
        self.held, self.probe, self.active = [], None, False
