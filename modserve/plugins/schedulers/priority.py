"""Priority scheduling: lower ``priority`` values run first, FCFS among equals."""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from modserve.api import (
    Schedule, Scheduler, SchedulerLimits, SchedulerView, Sequence, SequenceStatus, admit, advance_running,
    start_budget)


class PriorityOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_wait_s: float = Field(30.0, gt=0, description="A sequence waiting longer ranks above every priority")


class PriorityScheduler(Scheduler):
    """Running sequences advance in rank order, and when blocks run out the
    lowest-ranked is preempted. A waiting sequence that outranks the lowest running
    one preempts it rather than wait for blocks. Anything waiting longer than
    ``max_wait_s`` outranks every priority, so low priority cannot starve."""

    def __init__(self, limits: SchedulerLimits, options: PriorityOptions | None = None) -> None:
        super().__init__(limits, options)
        self.max_wait = (options or PriorityOptions()).max_wait_s

    def rank(self, seq: Sequence, now: float) -> tuple[float, float, int]:
        aged = seq.status is not SequenceStatus.RUNNING and now - seq.arrival_time > self.max_wait
        return (float("-inf") if aged else seq.priority, seq.arrival_time, seq.seq_id)

    def schedule(self, view: SchedulerView) -> Schedule:
        now = time.perf_counter()
        out = Schedule()
        budget = start_budget(view)
        running = sorted(view.running, key=lambda s: self.rank(s, now))
        candidates = sorted([*view.swapped, *view.waiting], key=lambda s: self.rank(s, now))
        # Make room for waiting work that outranks running work: evict from the bottom.
        for cand in candidates:
            if not running or self.rank(cand, now) >= self.rank(running[-1], now):
                break
            need = view.blocks_needed(cand, min(cand.num_tokens - cand.num_computed_tokens, budget.tokens))
            if need <= budget.blocks and budget.seqs > 0:
                break
            victim = running.pop()
            out.preempt.append(victim)
            budget.blocks += view.blocks_freed_by(victim)
            budget.seqs += 1
        advance_running(view, running, out, budget)
        admit(view, candidates, out, budget)
        return out
