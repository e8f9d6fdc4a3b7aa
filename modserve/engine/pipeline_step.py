"""Pipeline parallel with batches in flight (``pipeline_in_flight``, on when
pipeline_parallel_size > 1): up to ``pp_size`` steps of disjoint batches go through the
stages at once, so on decode every stage works, not one at a time.

One call of :meth:`PipelinedSteps.step`: while fewer than ``depth`` steps are in flight, the
scheduler picks a batch from the sequences not in flight (it hides those, and shares the
running ones about evenly between the steps) and rank 0 submits it: sends its message to
every rank, runs stage 0 and sends the hidden states on, without waiting for the later
stages. Then the oldest step is collected: its logits from the last stage, sampled, applied
by the scheduler, emitted. So while rank 0 samples step N and runs stage 0 of N+2, the last
stage runs N+1; with one sequence (one batch) a step is submitted and collected at once, as
without this. vLLM's engine core does the same with its batch queue
(``step_with_batch_queue``, as deep as the pipeline).

NOTE: a sequence is in at most one step in flight, so each step is scheduled, sampled and
checked (stops, grammar bitmask, penalties) and its drafts proposed (speculative decoding)
from exact state: greedy tokens are those of one step at a time. A sequence that ends while
its step is in flight (an abort) keeps its blocks until that step is applied or abandoned
(:meth:`SchedulerCore.settled`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from modserve.core.outputs import RequestOutput
from modserve.engine.output import stamp_scheduled
from modserve.runner.model_runner import StepInFlight

logger = logging.getLogger("modserve")


class PipelinedSteps:
    def __init__(self, engine: Any, depth: int) -> None:
        self.engine = engine  # the LLMEngine whose steps these are (not imported: it imports this)
        self.depth = depth
        self.in_flight: deque[StepInFlight] = deque()  # submitted, oldest first
        engine.scheduler.pipeline_depth = depth

    @property
    def pending(self) -> bool:
        return bool(self.in_flight)

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        # Culprit isolation runs one step at a time: it evicts every sequence between steps.
        depth = 1 if eng.isolation.active else self.depth
        while len(self.in_flight) < depth and eng.scheduler.has_work():
            scheduled = eng.scheduler.step(eng.spec.reserve(eng.scheduler.running, eng._max_tokens))
            eng.spec.propose(scheduled)  # from the sequences' applied tokens: the drafts are exact
            if not scheduled.seqs:  # every schedulable sequence is in flight
                break
            stamp_scheduled(eng.requests, scheduled.seqs, time.perf_counter())
            try:
                self.in_flight.append(eng.runner.submit(scheduled))
            except BaseException:
                eng.scheduler.settled(scheduled)
                raise
        if not self.in_flight:
            return []
        step = self.in_flight.popleft()
        try:
            output = eng.runner.collect(step)
        except BaseException:
            eng.scheduler.settled(step.scheduled)
            raise
        for seq in eng.scheduler.update(step.scheduled, output):
            eng.spec.forget(seq)
        eng.spec.count(step.scheduled, output)
        eng.counters["computed_tokens"] += step.scheduled.num_tokens
        eng.counters["steps"] += 1
        return eng._emit(output)

    def take_salvaged(self) -> list[RequestOutput]:
        """A step raised: the steps still in flight are abandoned (their logits taken, so the
        ranks stay in step, and dropped: their sequences compute those tokens again)."""
        self._drain(receive=True)
        return []

    def close(self) -> None:
        """Shutdown: abandon the steps in flight; their logits are taken only from ranks that
        are still in step (a dead or stuck rank would never send them)."""
        eng = self.engine
        self._drain(receive=eng.ranks_in_step and eng.executor.failed() is None)

    def _drain(self, receive: bool) -> None:
        eng = self.engine
        while self.in_flight:
            step = self.in_flight.popleft()
            try:
                if receive:
                    eng.runner.take_logits(step)
            except Exception as e:  # a rank gone meanwhile: the engine is dead, the blocks still go back
                logger.warning("pipeline: could not take the logits of a step in flight: %s", e)
                receive = False
            finally:
                eng.scheduler.settled(step.scheduled)
