"""Static batching: the pre-continuous-batching baseline."""

from __future__ import annotations

from modserve.api import Schedule, Scheduler, SchedulerView, admit, advance_running, start_budget


class StaticScheduler(Scheduler):
    """A batch is formed only when nothing runs: up to ``max_num_seqs`` waiting
    sequences whose prompts fit the step's token budget and the free blocks. It then
    runs until its longest member finishes; requests arriving meanwhile wait.
    Kept so ``modserve compare`` can show what continuous batching buys."""

    def schedule(self, view: SchedulerView) -> Schedule:
        out = Schedule()
        budget = start_budget(view)
        if view.running:
            advance_running(view, list(view.running), out, budget)
        else:
            admit(view, [*view.swapped, *view.waiting], out, budget)
        return out
