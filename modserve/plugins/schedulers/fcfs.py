"""First-come-first-served continuous batching with chunked prefill."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from modserve.core.interfaces import Schedule, Scheduler, SchedulerLimits, SchedulerView
from modserve.plugins.schedulers.base import admit, advance_running, start_budget


class FCFSOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="At most this many prompt tokens of one sequence per step (0: no cap)")


class FCFSScheduler(Scheduler):
    """Each step: advance every running sequence (decodes and unfinished prefill
    chunks) in admission order, then resume swapped sequences, then admit waiting
    ones in arrival order, while tokens, sequence slots and blocks last.

    With ``chunked_prefill`` (default) a prompt longer than what is left of the
    step's token budget is prefilled in chunks beside the running decodes; without
    it a prompt waits until it fits whole. ``long_prefill_token_threshold`` caps the
    chunk of any one prompt per step (vLLM's option of that name): a step that holds a
    new prompt stalls the running decodes for less time, and the prompt's first token
    comes some steps later. When blocks run out the newest running sequence is
    preempted, and nothing new is admitted in that step.
    """

    def __init__(self, limits: SchedulerLimits, options: FCFSOptions | None = None) -> None:
        super().__init__(limits, options)
        options = options or FCFSOptions()
        self.chunk, self.long_prefill = options.chunked_prefill, options.long_prefill_token_threshold
        if self.long_prefill and not self.chunk:
            raise ValueError("long_prefill_token_threshold needs chunked_prefill: a capped prompt is prefilled "
                             "in chunks")
        if not self.chunk and limits.max_num_batched_tokens < limits.max_model_len:
            raise ValueError(
                f"without chunked_prefill, max_num_batched_tokens ({limits.max_num_batched_tokens}) "
                f"must be at least max_model_len ({limits.max_model_len})"
            )

    def schedule(self, view: SchedulerView) -> Schedule:
        out = Schedule()
        budget = start_budget(view)
        advance_running(view, list(view.running), out, budget, self.chunk, self.long_prefill)
        if not out.preempt:
            admit(view, [*view.swapped, *view.waiting], out, budget, self.chunk, self.long_prefill)
        return out
