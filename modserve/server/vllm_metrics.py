"""vLLM's metric families (``metrics_naming: vllm``): the names, types, buckets and labels of
vLLM v1's ``PrometheusStatLogger`` (vllm/v1/metrics/loggers.py), so that dashboards, gateways
and autoscalers made for vLLM read modserve as they read vLLM.

Every family carries ``model_name`` (the served name) and ``engine`` (the data-parallel
replica; "0" without replicas). NOTE: what vLLM counts as a request is an engine request, and
vLLM v1 fans a request with ``n > 1`` out into n of them: modserve's sequences are the same
thing, so the gauges and per-request histograms here count samples, as vLLM's do.
"""

from __future__ import annotations

import re
import time
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from modserve.core.outputs import RequestOutput
from modserve.core.sampling_params import SamplingParams

LABELS = ["model_name", "engine"]
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's FinishReason as its label values; each is there from the start, at 0.
FINISH_REASONS = ("stop", "length", "abort", "error")
MAX_TRACKED = 65536  # requests whose max_tokens is remembered until they end (aborted ones never do)

# (family, engine.stats() key, help as vLLM's), read from the engines at scrape time.
_GAUGES = (
    ("vllm:num_requests_running", "num_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "kv_usage", "KV-cache usage. 1 means 100 percent usage."),
)
_COUNTERS = (
    ("vllm:prefix_cache_queries", "allocator_prefix_queried_tokens",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("vllm:prefix_cache_hits", "allocator_prefix_hit_tokens",
     "Prefix cache hits, in terms of number of cached tokens."),
    ("vllm:num_preemptions", "num_preemptions", "Cumulative number of preemption from the engine."),
    ("vllm:prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "generation_tokens", "Number of generation tokens processed."),
)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


def lora_requests_info(stats: dict[str, Any], name: str = "vllm:lora_requests_info") -> Iterator[Metric]:
    """vLLM's adapter gauge, which gateways read for adapter-affinity routing: the adapters of the
    running and of the waiting requests as comma-separated names in labels, the value the wall
    clock when read. Only with enable_lora, as vLLM."""
    if (lora := stats.get("lora")) is None:
        return
    family = GaugeMetricFamily(name, "Running stats on lora requests.",
                               labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    family.add_metric([str(lora["max_lora"]), ",".join(lora["waiting"]), ",".join(lora["running"])], time.time())
    yield family


def per_engine(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """Each engine's stats: a ReplicaSet's replicas, else the one engine's."""
    return stats.get("replicas") or [stats]


def engine_of(request_id: str) -> int:
    """The replica a request ran on: a ReplicaSet's replica i names its requests ``req-r{i}-...``."""
    found = re.match(r"req-r(\d+)-", request_id)
    return int(found.group(1)) if found else 0


class EngineStats(Collector):
    """vLLM's scheduler gauges and counters from the latest stats snapshot, one series per engine."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        engines = per_engine(self.stats)
        for kind, table in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for name, key, doc in table:
                family = kind(name, doc, labels=LABELS)
                for i, stats in enumerate(engines):
                    family.add_metric([self.model_name, str(i)], float(stats.get(key, 0)))
                yield family
        yield from lora_requests_info(self.stats)


class VllmMetrics:
    """The app's registry under vLLM's names; also the AsyncEngine's RequestObserver."""

    def __init__(self, model_name: str, max_model_len: int, num_engines: int = 1) -> None:
        self.registry = CollectorRegistry()
        self.max_model_len = max_model_len
        self.engine_stats = EngineStats(model_name)
        self.registry.register(self.engine_stats)
        engines = [str(i) for i in range(num_engines)]

        def histogram(name: str, doc: str, buckets) -> list[Any]:
            family = Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)
            return [family.labels(model_name, e) for e in engines]

        tokens = build_1_2_5_buckets(max_model_len)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           tokens)
        self.max_tokens_param = histogram("vllm:request_params_max_tokens",
                                          "Histogram of the max_tokens request parameter.", tokens)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          LABELS + ["finished_reason"], registry=self.registry)
        self.success = [{r: success.labels(model_name, e, r) for r in FINISH_REASONS} for e in engines]
        self.max_tokens: dict[str, int | None] = {}  # request id -> its max_tokens, until it ends
        self.seen_steps: list[tuple[int, int]] = [(0, 0)] * num_engines  # (steps, tokens) at the last scrape

    def request_started(self, request_ids: list[str], params: SamplingParams) -> None:
        for rid in request_ids:
            if len(self.max_tokens) >= MAX_TRACKED:
                del self.max_tokens[next(iter(self.max_tokens))]
            self.max_tokens[rid] = params.max_tokens

    def request_finished(self, output: RequestOutput) -> None:
        e = engine_of(output.request_id)
        m = output.metrics
        for family, value in ((self.ttft, m.ttft), (self.queue, m.queue_time), (self.prefill, m.prefill_time),
                              (self.decode, m.decode_time), (self.inference, m.inference_time)):
            if value is not None:
                family[e].observe(value)
        for gap in m.inter_token_latencies:
            self.itl[e].observe(gap)
        if m.finished_time is not None:
            self.e2e[e].observe(m.finished_time - m.arrival_time)
        prompt_len = len(output.prompt_token_ids)
        max_tokens = self.max_tokens.pop(output.request_id, None)
        for c in output.outputs:  # per sample: each is one of vLLM's engine requests
            self.success[e][_reason(c.finish_reason)].inc()
            self.prompt_tokens[e].observe(prompt_len)
            self.generation_tokens[e].observe(len(c.token_ids))
            self.max_tokens_param[e].observe(max_tokens if max_tokens is not None else self.max_model_len - prompt_len)

    def request_ended_early(self, reason: str) -> None:
        # NOTE: the observer is not told which request (or replica): counted under engine 0.
        self.success[0][_reason(reason)].inc()

    def render(self, stats: dict[str, Any]) -> bytes:
        self.engine_stats.stats = stats
        self._observe_steps(per_engine(stats))
        return generate_latest(self.registry)

    def _observe_steps(self, engines: list[dict[str, Any]]) -> None:
        """vllm:iteration_tokens_total from the engines' step and token counters: each step since
        the last scrape is observed at that interval's mean tokens per step (count and sum exact)."""
        for i, stats in enumerate(engines[:len(self.seen_steps)]):
            steps, tokens = stats.get("steps", 0), stats.get("computed_tokens", 0)
            last_steps, last_tokens = self.seen_steps[i]
            if steps > last_steps:
                mean = (tokens - last_tokens) / (steps - last_steps)
                for _ in range(steps - last_steps):
                    self.iteration_tokens[i].observe(mean)
            self.seen_steps[i] = (steps, tokens)


def _reason(reason: str | None) -> str:
    """vLLM's finished_reason for modserve's: a stream stalled unread is an abort there."""
    return reason if reason in FINISH_REASONS else "abort"
