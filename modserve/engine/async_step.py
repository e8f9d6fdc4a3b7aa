"""Asynchronous scheduling (``async_scheduling``): step N+1's forward runs while step N's
tokens become what the users see.

One call of :meth:`OverlappedSteps.step`: the scheduler has applied step N already (its EOS,
stop token ids, max_tokens, context limit and grammar advance), so step N+1 is scheduled now
with exact state (a grammar's bitmask for N+1 sees N's token); its forward goes to one
background thread while this thread detokenizes N's tokens, searches them for stop strings
and builds their RequestOutputs. Once the forward is done, a stop string found in N ends its
sequence (the token N+1 sampled for it is dropped unread, its blocks freed only now that the
forward no longer reads them), then the scheduler applies N+1, whose tokens are shown by the
next call.

NOTE: nothing is in flight between two calls: an abort, a preemption, shutdown and culprit
isolation see the synchronous engine's state, N+1's tokens applied but not yet shown. The
forward thread is the one that runs ``runner.execute``, which opens the forward context and
the LoRA mapping (thread-locals) itself.
"""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from modserve.core.outputs import RequestOutput
from modserve.core.step import ModelOutput, ScheduledStep
from modserve.engine.output import StopString, stamp_scheduled


class OverlappedSteps:
    def __init__(self, engine: Any) -> None:
        self.engine = engine  # the LLMEngine whose steps these are (not imported: it imports this)
        device = engine.runner.device
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="modserve-forward", initializer=_forward_thread,
                                       initargs=(torch.get_num_threads(), device))
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
        future: Future[ModelOutput] | None = None
        if scheduled is not None and scheduled.seqs:
            stamp_scheduled(eng.requests, scheduled.seqs, time.perf_counter())
            # In the engine thread's context: torch keeps its compile settings (torch._dynamo.config)
            # in context variables, which a new thread does not inherit.
            future = self.pool.submit(contextvars.copy_context().run, eng.runner.execute, scheduled)
        pending, self.pending = self.pending, None
        try:
            shown, stops, now = self._show(pending)
        except BaseException:
            if future is not None:
                wait([future])  # never return with the forward still reading the block tables
            raise
        try:
            output = future.result() if future is not None else None
        except Exception:
            self.salvaged = failed + self._settle(shown, stops, now)
            raise
        outputs = failed + self._settle(shown, stops, now)
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


def _forward_thread(num_threads: int, device: torch.device) -> None:
    """The forward thread runs as the engine thread would: its intra-op threads, its device."""
    torch.set_num_threads(num_threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
