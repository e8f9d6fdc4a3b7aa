"""What the engine hands back: per request, each sample's text, tokens and timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # One entry per generated token: {"token_id", "logprob", "rank", "top": {token_id: logprob}}
    logprobs: list[dict[str, Any]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sampled tokens' logprobs summed, as vLLM's: None unless logprobs were requested."""
        return None if self.logprobs is None else sum(e["logprob"] for e in self.logprobs)


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token of sample 0 arrived
    scheduled_time: float | None = None  # when the engine first scheduled it (None: not told)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    # vLLM's request phases (its v1 metrics); None while a time they span is unknown.
    @property
    def queue_time(self) -> float | None:
        return _span(self.arrival_time, self.scheduled_time)

    @property
    def prefill_time(self) -> float | None:
        return _span(self.scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        return _span(self.first_token_time, self.token_times[-1] if self.token_times else None)

    @property
    def inference_time(self) -> float | None:
        return _span(self.scheduled_time, self.token_times[-1] if self.token_times else None)

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing
    # predicts it), the others in CompletionOutput.logprobs' format; shared by the n samples.
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    # Why the engine failed this request (finish_reason "error"): a fault inside a step
    # that was traced to it alone; the other requests of that step went on.
    error: str | None = None
    # "plugin": a plugin broke its contract, and ``error`` (a PluginError's message) names it;
    # "kv_load": the KV connector could not load its blocks (kv_load_failure_policy: fail), and
    # ``error`` names the connector and the blocks; "engine": any other fault.
    error_kind: Literal["plugin", "kv_load", "engine"] | None = None
