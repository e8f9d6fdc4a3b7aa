"""The output processor: what a request's user sees of each step. Token ids become text, stop
strings are found in it, logprob rows become entries, and each touched request gets a
:class:`RequestOutput`.

It reads the sequences and never writes them (the scheduler does): a stop string it finds
goes back to the engine as a :class:`StopString`, which the scheduler applies. It owns what
only the user side needs: each sample's text, detokenizer and logprob entries, and each
request's metrics and prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Mapping

from modserve.core.contracts.sampler import SamplerOutput
from modserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from modserve.core.sampling_params import SamplingParams
from modserve.core.sequence import Sequence
from modserve.core.step import ModelOutput
from modserve.engine.tokenizer import IncrementalDecoder


@dataclass(slots=True)
class SampleText:
    """One sample's user side: its text so far and the logprob entries of its tokens."""

    detok: IncrementalDecoder
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    seen: int = 0  # output tokens already turned into text and entries


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]  # the n samples, by index
    samples: list[SampleText]  # their user side, by index
    metrics: RequestMetrics
    # With params.prompt_logprobs: an entry per prompt token scored so far, [None] at first.
    prompt_logprobs: list[dict[str, Any] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass(frozen=True, slots=True)
class StopString:
    """A stop string found in a sample's text: it ends there, keeping ``num_output_tokens``."""

    seq: Sequence
    stop: str
    num_output_tokens: int


class OutputProcessor:
    def __init__(self, eos_token_ids: Collection[int]) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)

    def process(self, output: ModelOutput, requests: Mapping[str, Request],
                now: float) -> tuple[list[Request], list[StopString], int]:
        """Read the tokens the scheduler appended this step: the requests touched, the stop
        strings found (the tokens after one are not read), and how many tokens were read."""
        _add_prompt_logprobs(output, requests)
        touched: dict[str, Request] = {}
        stops, num_read = [], 0
        row = 0  # this sequence's first row in output.samples
        for seq, tokens in output.token_ids.items():
            req = requests.get(seq.request_id)
            if req is None or req.seqs[seq.index] is not seq:  # ended after its step ran, before it was read
                row += len(tokens)
                continue
            touched[seq.request_id] = req
            sample = req.samples[seq.index]
            for i, token in enumerate(seq.output_token_ids[sample.seen:]):
                num_read += 1
                if stop := self._read(req, seq, sample, token, now, output.samples, row + i):
                    stops.append(StopString(seq, stop, sample.seen))
                    break
            row += len(tokens)
        return list(touched.values()), stops, num_read

    def _read(self, req: Request, seq: Sequence, sample: SampleText, token: int, now: float,
              out: SamplerOutput | None, row: int) -> str | None:
        """One appended token: its time, its logprob entry, its text; the stop string it completes."""
        params = seq.params
        sample.seen += 1
        if seq.index == 0:
            req.metrics.token_times.append(now)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
        if params.logprobs is not None:
            sample.logprobs.append(logprob_entry(out, row, params.logprobs))
        if sample.seen == seq.num_output_tokens and seq.finish_reason == "abort":
            return None  # the grammar rejected it: no text
        if not params.detokenize or token in params.stop_token_ids or (token in self.eos_token_ids
                                                                       and not params.ignore_eos):
            return None  # no text asked for, or a stop token (which is not text)
        delta = sample.detok.step(token)
        if not delta:
            return None
        sample.text += delta
        # NOTE: as vLLM, no stop string ends the first min_tokens tokens: only text after them is searched.
        if not params.stop or sample.seen <= params.min_tokens:
            return None
        return _stop_string(sample, params, len(delta))

    def output(self, req: Request, now: float | None = None) -> RequestOutput:
        """The request as its user sees it now; ``now`` marks a finished one's end."""
        if now is not None and req.finished:
            req.metrics.finished_time = now
        completions = []
        for seq, sample in zip(req.seqs, req.samples):
            text = sample.text
            if seq.finish_reason is None and seq.params.stop:
                # Hold back what could still turn out to be the start of a stop string.
                hold = max(len(s) for s in seq.params.stop) - 1
                text = text[: max(0, len(text) - hold)]
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=list(sample.logprobs) if seq.params.logprobs is not None else None,
            ))
        # NOTE: not copied: the entries are complete before the first output with a token.
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             req.finished, req.metrics, max(0, req.seqs[0].num_cached_tokens),
                             prompt_logprobs=req.prompt_logprobs)


def stamp_scheduled(requests: Mapping[str, Request], seqs: Collection[Sequence], now: float) -> None:
    """The first step that schedules a request ends its queue time (vLLM's scheduled_ts)."""
    for seq in seqs:
        metrics = requests[seq.request_id].metrics
        if metrics.scheduled_time is None:
            metrics.scheduled_time = now


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


def _stop_string(sample: SampleText, params: SamplingParams, delta_len: int) -> str | None:
    """The first stop string the text's last ``delta_len`` characters complete; the text is cut
    at it (after it with include_stop_str_in_output)."""
    longest = max(len(s) for s in params.stop)
    start = max(0, len(sample.text) - delta_len - longest + 1)
    hits = [(i, s) for s in params.stop if (i := sample.text.find(s, start)) != -1]
    if not hits:
        return None
    i, stop = min(hits)
    sample.text = sample.text[: i + len(stop)] if params.include_stop_str_in_output else sample.text[:i]
    return stop


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
