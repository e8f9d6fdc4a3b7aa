"""The engine's side of a step's outputs: each request's new tokens, their logprob entries and
how its samples ended, read from the sequences as the scheduler left them and handed on as
:class:`CoreOutput`s (token ids, never text: vLLM's EngineCoreOutput).

It reads the sequences and never writes them (the scheduler does). In an engine-core process
(:class:`TokenReader`) the CoreOutputs go to the API server, whose output processor
(``output_processor.py``) makes the text; in-process (:class:`InProcessOutputs`) the same
output processor runs here, and a stop string it finds goes back to the engine as a
:class:`StopString`, which the scheduler applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Mapping

from modserve.core.contracts.sampler import SamplerOutput
from modserve.core.outputs import RequestOutput
from modserve.core.sampling_params import SamplingParams
from modserve.core.sequence import Sequence
from modserve.core.step import ModelOutput
from modserve.engine.core_protocol import CoreOutput, SampleOutput
from modserve.engine.output_processor import OutputProcessor, RequestState


@dataclass(slots=True)
class SampleNews:
    """One sample's tokens read from its sequence and not yet handed on, with their logprob entries."""

    read: int = 0  # output tokens read so far
    ids: list[int] = field(default_factory=list)  # the tokens read and not handed on
    logprobs: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]  # the n samples, by index
    news: list[SampleNews]  # what each has not handed on yet, by index
    # With params.prompt_logprobs: an entry per prompt token scored so far, [None] at first.
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_sent: int = 1  # prompt entries handed on
    scheduled_time: float | None = None
    user: RequestState | None = None  # in-process: what its user sees (InProcessOutputs)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass(frozen=True, slots=True)
class StopString:
    """A stop string found in a sample's text: it ends there, keeping ``num_output_tokens``."""

    seq: Sequence
    stop: str
    num_output_tokens: int


class TokenReader:
    """An engine-core process's outputs: CoreOutputs, for the API server's output processor."""

    def add(self, req: Request, prompt: str | None, arrival_time: float) -> None:
        """A new request (its user side is the API server's)."""

    def process(self, output: ModelOutput, requests: Mapping[str, Request],
                now: float) -> tuple[list[Request], list[StopString], int]:
        """Read the tokens the scheduler appended this step: the requests touched, the stop
        strings found (none here: the API server finds them), and how many tokens were read."""
        touched, num_read = self.read(output, requests)
        return touched, [], num_read

    def read(self, output: ModelOutput, requests: Mapping[str, Request]) -> tuple[list[Request], int]:
        _add_prompt_logprobs(output, requests)
        touched: dict[str, Request] = {}
        num_read, row = 0, 0  # row: this sequence's first row in output.samples
        for seq, tokens in output.token_ids.items():
            req = requests.get(seq.request_id)
            if req is None or req.seqs[seq.index] is not seq:  # ended after its step ran, before it was read
                row += len(tokens)
                continue
            touched[seq.request_id] = req
            news = req.news[seq.index]
            new = seq.token_ids[seq.num_prompt_tokens + news.read:]  # not a copy of every output token first
            if seq.params.logprobs is not None:
                news.logprobs += [logprob_entry(output.samples, row + i, seq.params.logprobs) for i in range(len(new))]
            news.ids += new
            news.read += len(new)
            num_read += len(new)
            row += len(tokens)
        return list(touched.values()), num_read

    def output(self, req: Request, now: float | None = None) -> CoreOutput | RequestOutput:
        """What changed of ``req`` since its last output; ``now``: when its step's tokens were read."""
        return collect(req, now)

    shown = output  # ``req``'s output for a step ``process`` has just read: here, the same


class InProcessOutputs(TokenReader):
    """An engine stepping in this process (``LLM``, the server's engine thread): the output
    processor runs here, on each step's CoreOutputs, and its outputs are RequestOutputs."""

    def __init__(self, processor: OutputProcessor) -> None:
        self.processor = processor

    def add(self, req: Request, prompt: str | None, arrival_time: float) -> None:
        req.user = self.processor.new_request(req.request_id, prompt, req.prompt_token_ids, req.params, arrival_time)

    def process(self, output: ModelOutput, requests: Mapping[str, Request],
                now: float) -> tuple[list[Request], list[StopString], int]:
        """As TokenReader's, with the stop strings the text holds (the tokens after one are not read)."""
        touched, _ = self.read(output, requests)
        stops, num_read = [], 0
        for req in touched:
            hits, n = self.processor.update(req.user, collect(req, now))  # type: ignore[arg-type]
            stops += [StopString(req.seqs[h.index], h.stop, h.num_output_tokens) for h in hits]
            num_read += n
        return touched, stops, num_read

    def output(self, req: Request, now: float | None = None) -> RequestOutput:
        """The request as its user sees it now; ``now`` marks a finished one's end."""
        self.processor.update(req.user, collect(req, now))  # type: ignore[arg-type]
        return self.processor.output(req.user)  # type: ignore[arg-type]

    def shown(self, req: Request, now: float | None = None) -> RequestOutput:
        """``process`` read the step already (a stop string in it ended its sample there): no second read."""
        return self.processor.output(req.user)  # type: ignore[arg-type]


def collect(req: Request, now: float | None) -> CoreOutput:
    """``req``'s news as a CoreOutput; its news are handed on (emptied)."""
    samples = []
    for index, (seq, news) in enumerate(zip(req.seqs, req.news)):
        samples.append(SampleOutput(index, news.ids, news.logprobs if seq.params.logprobs is not None else None,
                                    seq.finish_reason, seq.stop_reason))
        news.ids, news.logprobs = [], []
    prompt = None
    if req.prompt_logprobs is not None and len(req.prompt_logprobs) > req.prompt_sent:
        prompt, req.prompt_sent = req.prompt_logprobs[req.prompt_sent:], len(req.prompt_logprobs)
    return CoreOutput(req.request_id, samples, now, max(0, req.seqs[0].num_cached_tokens), req.scheduled_time,
                      prompt, req.finished)


def new_request(request_id: str, token_ids: list[int], params: SamplingParams, seqs: list[Sequence]) -> Request:
    return Request(request_id, token_ids, params, seqs, [SampleNews() for _ in seqs],
                   None if params.prompt_logprobs is None else [None])


def stamp_scheduled(requests: Mapping[str, Request], seqs: Collection[Sequence], now: float) -> None:
    """The first step that schedules a request ends its queue time (vLLM's scheduled_ts)."""
    for seq in seqs:
        req = requests[seq.request_id]
        if req.scheduled_time is None:
            req.scheduled_time = now


def _add_prompt_logprobs(output: ModelOutput, requests: Mapping[str, Request]) -> None:
    for seq, (first, row, num_rows) in output.prompt_seqs.items():
        req = requests.get(seq.request_id)
        if req is None or req.seqs[seq.index] is not seq:  # ended before its step was read (async scheduling)
            continue
        entries = req.prompt_logprobs
        # NOTE: a recompute (preemption; a fork that waited for a slot) scores the prompt
        # again from position 0: the entries it already has are skipped, none is lost.
        for i in range(len(entries) - first, num_rows):
            entries.append(logprob_entry(output.prompt_samples, row + i, seq.params.prompt_logprobs))


def logprob_entry(out: SamplerOutput, row: int, num_top: int) -> dict[str, Any]:
    entry = {
        "token_id": int(out.token_ids[row]),
        "logprob": float(out.logprobs[row]),
        "rank": int(out.ranks[row]),
        "top": {},
    }
    if num_top and out.top_ids is not None:
        ids = out.top_ids[row, :num_top].tolist()
        lps = out.top_logprobs[row, :num_top].tolist()
        entry["top"] = dict(zip(ids, lps))
    return entry
