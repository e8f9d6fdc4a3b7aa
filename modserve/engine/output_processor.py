"""The output processor: what a request's user sees of the engine's token ids (vLLM's v1
OutputProcessor). Each sample's tokens become text, the text is searched for stop strings, and
each request touched gets a :class:`RequestOutput`.

It reads :class:`CoreOutput`s, the token ids, logprob entries and finish reasons a step made,
and holds each request's user side: its samples' detokenizers, text, tokens and logprob entries,
its metrics and prompt logprobs. One class for both places an engine runs: in an API server
beside an engine-core process (``modserve.server.engine_process``), and in-process beside the
engine (``LLM``, the server's engine thread; ``modserve.engine.output.InProcessOutputs``).

A stop string found ends its sample here at once, cut at the token that completed it (the
user never sees past it); the :class:`StopHit` returned goes to the engine, which ends the
sequence there. An engine in another process may have sampled on meanwhile: what it sends of
a sample that ended here is not read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from modserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from modserve.core.sampling_params import SamplingParams
from modserve.engine.core_protocol import CoreOutput
from modserve.engine.tokenizer import IncrementalDecoder, Tokenizer


@dataclass(slots=True)
class SampleState:
    """One sample as its user sees it: its tokens, their text and logprob entries, how it ended."""

    detok: IncrementalDecoder
    text: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def finish(self, reason: str | None, stop_reason: str | int | None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]  # the n samples, by index
    metrics: RequestMetrics
    # With params.prompt_logprobs: an entry per prompt token scored so far, [None] at first.
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_kind: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def note(self, out: CoreOutput) -> None:
        """The request-wide parts of ``out``: prompt logprobs, cached tokens, times, an error."""
        if out.prompt_logprobs:
            self.prompt_logprobs.extend(out.prompt_logprobs)  # type: ignore[union-attr]
        self.num_cached_tokens = out.num_cached_tokens
        if out.scheduled_time is not None:
            self.metrics.scheduled_time = out.scheduled_time
        if out.error is not None:
            self.error, self.error_kind = out.error, out.error_kind
        if out.time is not None and self.finished:
            self.metrics.finished_time = out.time


@dataclass(frozen=True, slots=True)
class StopHit:
    """A stop string found in a sample's text: the sample ends there, keeping ``num_output_tokens``."""

    request_id: str
    index: int
    stop: str
    num_output_tokens: int


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.requests: dict[str, RequestState] = {}  # those added with ``add``

    def new_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> RequestState:
        samples = [SampleState(self.tokenizer.stream(params.skip_special_tokens)) for _ in range(params.n)]
        return RequestState(request_id, prompt, prompt_token_ids, params, samples,
                            RequestMetrics(arrival_time=arrival_time),
                            None if params.prompt_logprobs is None else [None])

    # -- by request id (an API server's) -------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float) -> None:
        self.requests[request_id] = self.new_request(request_id, None, prompt_token_ids, params, arrival_time)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, outputs: Iterable[CoreOutput]) -> tuple[list[RequestOutput], list[StopHit]]:
        """The outputs of the requests added here (others, forgotten, are skipped) and the stop
        strings found; a request that ended is forgotten."""
        shown, stops = [], []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:  # aborted, or ended here (a stop string) before the core knew
                continue
            stops += self.update(state, out)[0]
            shown.append(self.output(state))
            if state.finished or state.error is not None:
                del self.requests[out.request_id]
        return shown, stops

    # -- one request ----------------------------------------------------------------------------
    def update(self, state: RequestState, out: CoreOutput) -> tuple[list[StopHit], int]:
        """Read ``out`` into ``state``: the stop strings found, and how many tokens were read
        (the ones after a stop string are not)."""
        stops, num_read = [], 0
        for news in out.samples:
            sample = state.samples[news.index]
            if sample.finish_reason is not None:
                continue  # ended here (a stop string): the engine's later tokens are not shown
            for i, token in enumerate(news.token_ids):
                num_read += 1
                last = i == len(news.token_ids) - 1
                if stop := self._read(state, news.index, sample, token, out.time, news.logprobs, i,
                                      last and news.finish_reason == "abort"):
                    stops.append(StopHit(state.request_id, news.index, stop, len(sample.output_token_ids)))
                    sample.finish("stop", stop)
                    break
            else:
                sample.finish(news.finish_reason, news.stop_reason)
        state.note(out)
        return stops, num_read

    def _read(self, state: RequestState, index: int, sample: SampleState, token: int, now: float | None,
              logprobs: list[dict[str, Any]] | None, i: int, rejected: bool) -> str | None:
        """One token: its time, its logprob entry, its text; the stop string it completes."""
        params = state.params
        sample.output_token_ids.append(token)
        if index == 0 and now is not None:
            state.metrics.token_times.append(now)
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
        if logprobs is not None:
            sample.logprobs.append(logprobs[i])
        if rejected:
            return None  # the grammar rejected it: no text
        if not params.detokenize or token in params.stop_token_ids or (token in self.eos_token_ids
                                                                       and not params.ignore_eos):
            return None  # no text asked for, or a stop token (which is not text)
        delta = sample.detok.step(token)
        if not delta:
            return None
        sample.text += delta
        # NOTE: as vLLM, no stop string ends the first min_tokens tokens: only text after them is searched.
        if not params.stop or len(sample.output_token_ids) <= params.min_tokens:
            return None
        return _stop_string(sample, params, len(delta))

    def output(self, state: RequestState) -> RequestOutput:
        """The request as its user sees it now."""
        params, completions = state.params, []
        for index, sample in enumerate(state.samples):
            text = sample.text
            if sample.finish_reason is None and params.stop:
                # Hold back what could still turn out to be the start of a stop string.
                hold = max(len(s) for s in params.stop) - 1
                text = text[: max(0, len(text) - hold)]
            completions.append(CompletionOutput(
                index=index, text=text, token_ids=list(sample.output_token_ids), finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason, logprobs=list(sample.logprobs) if params.logprobs is not None else None,
            ))
        # NOTE: not copied: the entries are complete before the first output with a token.
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             state.finished, state.metrics, state.num_cached_tokens,
                             prompt_logprobs=state.prompt_logprobs, error=state.error,
                             error_kind=state.error_kind)  # type: ignore[arg-type]


def _stop_string(sample: SampleState, params: SamplingParams, delta_len: int) -> str | None:
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
