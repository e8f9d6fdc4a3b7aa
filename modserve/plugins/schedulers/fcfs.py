"""First-come-first-served continuous batching with chunked prefill."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from modserve.core.interfaces import Schedule, Scheduler, SchedulerLimits, SchedulerView
from modserve.plugins.schedulers.base import admit, advance_running, start_budget


class FCFSOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    chunked_prefill: bool = True


class FCFSScheduler(Scheduler):
    """Each step: advance every running sequence (decodes and unfinished prefill
    chunks) in admission order, then resume swapped sequences, then admit waiting
    ones in arrival order, while tokens, sequence slots and blocks last.

    With ``chunked_prefill`` (default) a prompt longer than what is left of the
    step's token budget is prefilled in chunks beside the running decodes; without
    it a prompt waits until it fits whole. When blocks run out the newest running
    sequence is preempted, and nothing new is admitted in that step.
    """

    def __init__(self, limits: SchedulerLimits, options: FCFSOptions | None = None) -> None:
        super().__init__(limits, options)
        self.chunk = (options or FCFSOptions()).chunked_prefill
        if not self.chunk and limits.max_num_batched_tokens < limits.max_model_len:
            raise ValueError(
                f"without chunked_prefill, max_num_batched_tokens ({limits.max_num_batched_tokens}) "
                f"must be at least max_model_len ({limits.max_model_len})"
            )

    def schedule(self, view: SchedulerView) -> Schedule:
        out = Schedule()
        budget = start_budget(view)
        advance_running(view, list(view.running), out, budget, self.chunk)
        if not out.preempt:
            admit(view, [*view.swapped, *view.waiting], out, budget, self.chunk)
        return out
