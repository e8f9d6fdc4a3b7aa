"""First-come-first-served continuous batching with chunked prefill."""

from __future__ import annotations

from collections import Counter
from typing import Iterator

from pydantic import BaseModel, ConfigDict, Field

from modserve.api import (
    Budget, Schedule, Scheduler, SchedulerLimits, SchedulerView, Sequence, admit, advance_running,
    start_budget)


class FCFSOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="At most this many prompt tokens of one sequence per step (0: no cap)")
    fair_share: bool = Field(
        True, description="While another request waits, no request holds more than half of max_num_seqs "
        "(a request with a large n gives back its newest sequences), and over-share sequences are "
        "preempted first when blocks run short")


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

    With ``fair_share`` (default) one request cannot starve the others: while a
    sequence of another request waits, a request holds at most half the sequence
    slots (its newest sequences beyond that are preempted, and it admits no more), and
    when blocks run short the sequences of a request over that share go first. With no
    request over half the slots, the schedule is the plain one above.
    """

    def __init__(self, limits: SchedulerLimits, options: FCFSOptions | None = None) -> None:
        super().__init__(limits, options)
        options = options or FCFSOptions()
        self.chunk, self.long_prefill = options.chunked_prefill, options.long_prefill_token_threshold
        self.fair = options.fair_share
        self.share = max(1, limits.max_num_seqs // 2)
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
        order = list(view.running)
        candidates: Iterator[Sequence] | list[Sequence] = [*view.swapped, *view.waiting]
        if self.fair and len(order) > self.share:  # else no request can be over its share yet
            order = self._give_back_over_share(view, order, out, budget)
        if self.fair and candidates:
            candidates = self._within_share(candidates, order, out)
        fairness_preemptions = len(out.preempt)
        advance_running(view, order, out, budget, self.chunk, self.long_prefill)
        if len(out.preempt) == fairness_preemptions:  # nothing preempted for lack of blocks
            admit(view, candidates, out, budget, self.chunk, self.long_prefill)
        return out

    def _give_back_over_share(self, view: SchedulerView, order: list[Sequence], out: Schedule,
                              budget: Budget) -> list[Sequence]:
        """Preempt each request's newest sequences beyond the share while another request
        waits; return the running order with over-share requests' sequences last."""
        held = Counter(s.request_id for s in order)
        if not held or max(held.values()) <= self.share:
            return order
        waiting = {s.request_id for s in (*view.waiting, *view.swapped)}
        for rid, count in held.items():
            if count > self.share and waiting - {rid}:
                for victim in [s for s in order if s.request_id == rid][self.share:]:
                    order.remove(victim)
                    out.preempt.append(victim)
                    budget.blocks += view.blocks_freed_by(victim)
                    budget.seqs += 1
                    held[rid] -= 1
        # Stable: admission order within each group. When blocks run short, advance_running
        # preempts from the end, so a request over its share gives back first.
        return sorted(order, key=lambda s: held[s.request_id] > self.share)

    def _within_share(self, candidates: list[Sequence], order: list[Sequence], out: Schedule) -> Iterator[Sequence]:
        """The candidates in arrival order, less those of a request already at its share
        while another request's sequences wait (admit consumes this lazily)."""
        held = Counter(s.request_id for s in order)
        waiting = Counter(s.request_id for s in candidates)
        for seq in candidates:
            rid = seq.request_id
            others_wait = sum(waiting.values()) - waiting[rid] > 0
            if held[rid] >= self.share and others_wait:
                continue
            yield seq
            if seq in out.tokens:  # admit took it
                held[rid] += 1
                waiting[rid] -= 1
