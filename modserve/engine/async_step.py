"""Asynchronous scheduling (``async_scheduling``): step N+1's forward runs while step N's
tokens become what the users see.

One call of :meth:`OverlappedSteps.step`: the scheduler has applied step N already (its EOS,
stop token ids, max_tokens, context limit and grammar advance), so step N+1 is scheduled now
with exact state (a grammar's bitmask for N+1 sees N's token); one background thread
detokenizes N's tokens, searches them for stop strings and builds their RequestOutputs while
this thread runs N+1's forward. Once both are done, a stop string found in N ends its
sequence (the token N+1 sampled for it is dropped unread, its blocks freed only now that the
forward no longer reads them), then the scheduler applies N+1, whose tokens are shown by the
next call.

The forward stays on the engine thread, which loaded the model and owns its OpenMP team: a
forward on a thread of its own would start a second team, and every kernel would then wait
for a sleeping thread (modserve/engine/intra_op_threads.py says why). The output thread runs
no parallel kernel: it reads the sampler's tensors as lists. (torch.set_num_threads is not
the way to keep it from starting a team: it sets the count of every thread that has not run
a parallel kernel yet.)

NOTE: nothing is in flight between two calls: an abort, a preemption, shutdown and culprit
isolation see the synchronous engine's state, N+1's tokens applied but not yet shown.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from modserve.core.outputs import RequestOutput
from modserve.core.step import ModelOutput, ScheduledStep
from modserve.engine.output import StopString, stamp_scheduled


class OverlappedSteps:
    def __init__(self, engine: Any) -> None:
        self.engine = engine  # the LLMEngine whose steps these are (not imported: it imports this)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="modserve-outputs")
        self.pending: ModelOutput | None = None  # applied by the scheduler, not shown yet
        self.salvaged: list[RequestOutput] = []  # shown by a step whose forward then raised

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def take_salvaged(self) -> list[RequestOutput]:
        """The outputs of the step whose forward raised: the users still get them."""
        out, self.salvaged = self.salvaged, []
        return out

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        scheduled = None
        if eng.scheduler.has_work():
            scheduled = eng.scheduler.step(eng.spec.reserve(eng.scheduler.running, eng._max_tokens))
            eng.spec.propose(scheduled)  # from the tokens the scheduler applied: the drafts are exact
        failed = eng._load_kv(scheduled) if scheduled is not None and scheduled.kv_loads else []
        forward = scheduled is not None and bool(scheduled.seqs)
        if forward:
            stamp_scheduled(eng.requests, scheduled.seqs, time.perf_counter())
        pending, self.pending = self.pending, None
        showing = self.pool.submit(self._show, pending)
        try:
            output = eng.runner.execute(scheduled) if forward else None
        except BaseException as e:
            wait([showing])  # never leave the outputs half built
            if isinstance(e, Exception) and showing.exception() is None:
                self.salvaged = failed + self._settle(*showing.result())
            raise
        outputs = failed + self._settle(*showing.result())  # raises what _show raised
        if output is not None:
            self._apply(scheduled, output)
        return outputs

    def _show(self, pending: ModelOutput | None) -> tuple[dict[str, RequestOutput], list[StopString], float]:
        """Step N's tokens as text and outputs (meanwhile N+1's forward runs): request id -> its
        output, and the stop strings found (applied once the forward is done)."""
        now = time.perf_counter()
        if pending is None:
            return {}, [], now
        eng = self.engine
        touched, stops, num_read = eng.outputs.process(pending, eng.requests, now)
        eng.counters["generation_tokens"] += num_read
        return {req.request_id: eng.outputs.shown(req, now) for req in touched}, stops, now

    def _settle(self, shown: dict[str, RequestOutput], stops: list[StopString], now: float) -> list[RequestOutput]:
        """With the forward done: end the sequences at their stop strings (dropping what they
        sampled since), and let go of the requests whose last output this is."""
        eng = self.engine
        for hit in stops:
            if not hit.seq.is_finished:
                eng.spec.forget(hit.seq)
            eng.scheduler.finish(hit.seq, "stop", hit.stop, hit.num_output_tokens)
            shown[hit.seq.request_id] = eng.outputs.output(eng.requests[hit.seq.request_id], now)
        for rid, out in shown.items():
            if out.finished:
                del eng.requests[rid]
        return list(shown.values())

    def _apply(self, scheduled: ScheduledStep, output: ModelOutput) -> None:
        eng = self.engine
        for seq in eng.scheduler.update(scheduled, output):  # skips those a stop string ended meanwhile
            eng.spec.forget(seq)
        eng.spec.count(scheduled, output)
        eng.counters["computed_tokens"] += scheduled.num_tokens
        eng.counters["steps"] += 1
        self.pending = output

