"""shortest_first: shortest-remaining-prompt-first admission, with an age bound.

Short prompts reach their first token sooner when they need not queue behind long ones
(lower mean time to first token on mixed workloads). Pure shortest-first starves: a long
prompt could wait forever behind a stream of short ones. So a sequence waiting longer than
``max_wait_s`` goes before every younger one, oldest first, and ``admit`` never lets a
later candidate overtake one that does not fit: once overdue, a sequence is next.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from modserve.api import (
    Schedule, Scheduler, SchedulerLimits, SchedulerView, SequenceView, admit, advance_running, start_budget)


class ShortestFirstOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_wait_s: float = Field(
        10.0, gt=0, description="A sequence waiting longer than this is admitted before any younger one "
        "(oldest first), however long its prompt: the bound that prevents starvation")


class ShortestFirstScheduler(Scheduler):
    """Each step: advance every running sequence (decodes and unfinished prefill chunks) in
    admission order, preempting the newest when blocks run short; then resume swapped
    sequences; then admit waiting ones, overdue first (oldest first), then the rest by the
    tokens left to compute (fewest first, ties by arrival), while tokens, sequence slots and
    blocks last. Long prompts are prefilled in chunks beside the running decodes."""

    def __init__(self, limits: SchedulerLimits, options: ShortestFirstOptions | None = None) -> None:
        super().__init__(limits, options)
        self.max_wait = (options or ShortestFirstOptions()).max_wait_s

    def rank(self, seq: SequenceView, now: float) -> tuple[int, float, float]:
        if now - seq.arrival_time > self.max_wait:
            return (0, seq.arrival_time, seq.seq_id)  # overdue: oldest first
        return (1, seq.num_uncomputed, seq.arrival_time)

    def schedule(self, view: SchedulerView) -> Schedule:
        now = time.perf_counter()
        out = Schedule()
        budget = start_budget(view)
        # Running work first: a sequence already admitted holds blocks, and each step it
        # does not advance is a step its blocks sit idle.
        advance_running(view, list(view.running), out, budget)
        if out.preempt:  # blocks ran short: what is admitted now would only be preempted next
            return out
        waiting = sorted(view.waiting, key=lambda seq: self.rank(seq, now))
        # Swapped sequences resume first: their KV is kept on the host, so they lose nothing.
        admit(view, [*view.swapped, *waiting], out, budget)
        return out
