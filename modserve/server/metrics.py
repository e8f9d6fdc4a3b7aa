"""Prometheus metrics: engine gauges and counters read at scrape time, request timings as they end.

Each app has its own CollectorRegistry, so several servers in one process
(tests) never clash over metric names.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from modserve.core.outputs import RequestOutput
from modserve.core.sampling_params import SamplingParams
from modserve.server.vllm_metrics import VllmMetrics, lora_requests_info

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                    40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8, 1.0, 2.5)

# (metric name, engine.stats() key, help). Gauges are states; counters only ever grow.
_GAUGES = (
    ("modserve_num_requests_running", "num_running", "Sequences in the running batch (a request with n=2 counts 2)"),
    ("modserve_num_requests_waiting", "num_waiting", "Sequences waiting to be scheduled"),
    ("modserve_num_requests_swapped", "num_swapped", "Sequences whose KV is swapped out to host memory"),
    ("modserve_kv_blocks_total", "kv_blocks_total", "KV cache blocks in all"),
    ("modserve_kv_blocks_free", "kv_blocks_free", "KV cache blocks free"),
    ("modserve_kv_cache_usage_ratio", "kv_usage", "Fraction of KV cache blocks in use"),
)
_COUNTERS = (
    ("modserve_num_preemptions", "num_preemptions", "Sequences preempted for lack of KV blocks"),
    ("modserve_preemptions_recompute", "preemptions_recompute", "Preemptions whose KV was dropped, to recompute"),
    ("modserve_preemptions_swap", "preemptions_swap", "Preemptions whose KV was swapped to host memory"),
    ("modserve_kv_blocks_swapped_out", "blocks_swapped_out", "KV blocks copied to host memory"),
    ("modserve_kv_blocks_swapped_in", "blocks_swapped_in", "KV blocks copied back from host memory"),
    ("modserve_prefix_cache_queried_tokens", "allocator_prefix_queried_tokens",
     "Prompt tokens looked up in the prefix cache"),
    ("modserve_prefix_cache_hit_tokens", "allocator_prefix_hit_tokens", "Prompt tokens found in the prefix cache"),
    ("modserve_prefix_cache_evictions", "allocator_evictions", "Cached KV blocks evicted for reuse"),
    ("modserve_spec_proposed_tokens", "spec_proposed_tokens", "Draft tokens proposed for speculative decoding"),
    ("modserve_spec_accepted_tokens", "spec_accepted_tokens", "Draft tokens the target accepted"),
    ("modserve_spec_verifications", "spec_verifications", "Sequence-steps that verified drafts"),
    ("modserve_prompt_tokens", "prompt_tokens", "Prompt tokens received"),
    ("modserve_generation_tokens", "generation_tokens", "Tokens generated"),
    ("modserve_engine_steps", "steps", "Engine steps run"),
)


class EngineStatsCollector(Collector):
    """Turns the latest engine.stats() snapshot into metric families at scrape time.

    With data parallelism (a ReplicaSet's stats: the replicas' sums, each one's under
    ``replicas``, the router's under ``routing``) every metric above is the sum over the
    replicas, under its usual name and without labels, and each also comes per replica as
    ``modserve_replica_*{replica="i"}``: a name of its own, so that ``sum()`` over either
    never counts a replica twice.
    """

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        for name, key, doc in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=float(stats.get(key, 0)))
        yield GaugeMetricFamily("modserve_kv_blocks_used", "KV cache blocks in use", value=float(_used(stats)))
        for name, key, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0)))
        yield from _kv_connector(stats)
        yield from lora_requests_info(stats, "modserve_lora_requests_info")
        if stats.get("expert_tokens"):
            yield from _expert_load(stats["expert_tokens"])
        replicas = stats.get("replicas")
        if replicas:
            yield from _per_replica(replicas, stats.get("routing") or {})


# A KV connector's counters (the core's blocks loaded, saved and failed; the connector's own,
# such as the host tier's hits and bytes), each as modserve_kv_connector_*; sizes are gauges.
_KV_CONNECTOR_GAUGES = ("kv_connector_host_blocks_total", "kv_connector_host_blocks_used",
                        "kv_connector_blocks_held", "kv_connector_stored_bytes")


def _kv_connector(stats: dict[str, Any]) -> Iterator[Metric]:
    for key, value in stats.items():
        if key.startswith("kv_connector_") and isinstance(value, (int, float)):
            doc = f"KV connector: {key.removeprefix('kv_connector_').replace('_', ' ')}"
            family = GaugeMetricFamily if key in _KV_CONNECTOR_GAUGES else CounterMetricFamily
            yield family(f"modserve_{key}", doc, value=float(value))


def imbalance(counts: list[int]) -> float:
    """The hottest expert's tokens over the mean (1: even; E: one expert took every token)."""
    mean = sum(counts) / len(counts) if counts else 0
    return max(counts) / mean if mean else 0.0


def _expert_load(load: dict[int, list[int]]) -> Iterator[Metric]:
    """Mixture-of-experts models: tokens routed to each expert of each layer, and how uneven."""
    tokens = CounterMetricFamily("modserve_moe_expert_tokens", "Tokens routed to each expert of each MoE layer "
                                 "(a token counts once for each of its top-k experts)", labels=["layer", "expert"])
    uneven = GaugeMetricFamily("modserve_moe_expert_imbalance", "The hottest expert's routed tokens over the mean, "
                               "per MoE layer (1: even)", labels=["layer"])
    for layer, counts in sorted(load.items()):
        for expert, n in enumerate(counts):
            tokens.add_metric([str(layer), str(expert)], float(n))
        uneven.add_metric([str(layer)], imbalance(counts))
    yield tokens
    yield uneven


def _used(stats: dict[str, Any]) -> float:
    return stats.get("kv_blocks_total", 0) - stats.get("kv_blocks_free", 0)


def _replica_name(name: str) -> str:
    return "modserve_replica_" + name.removeprefix("modserve_")


def _per_replica(replicas: list[dict[str, Any]], routing: dict[str, Any]) -> Iterator[Metric]:
    labels = [str(i) for i in range(len(replicas))]

    def by_replica(family: Metric, value: Callable[[dict[str, Any]], float]) -> Metric:
        for label, stats in zip(labels, replicas):
            family.add_metric([label], float(value(stats)))
        return family

    per = ", per data-parallel replica"
    for name, key, doc in _GAUGES:
        yield by_replica(GaugeMetricFamily(_replica_name(name), doc + per, labels=["replica"]),
                         lambda stats, key=key: stats.get(key, 0))
    yield by_replica(GaugeMetricFamily("modserve_replica_kv_blocks_used", "KV cache blocks in use" + per,
                                       labels=["replica"]), _used)
    yield by_replica(GaugeMetricFamily("modserve_replica_alive", "1 while the replica's engine thread runs",
                                       labels=["replica"]), lambda stats: stats.get("alive", 0))
    for name, key, doc in _COUNTERS:
        yield by_replica(CounterMetricFamily(_replica_name(name), doc + per, labels=["replica"]),
                         lambda stats, key=key: stats.get(key, 0))
    routed = CounterMetricFamily("modserve_replica_routed_requests", "Prompts routed to the replica, by why: "
                                 "prefix (it held the longest part of the prompt) or load (the least loaded)",
                                 labels=["replica", "by"])
    for label, counts in zip(labels, routing.get("routed", [])):
        for by, value in sorted(counts.items()):
            routed.add_metric([label, by], float(value))
    yield routed
    yield CounterMetricFamily("modserve_router_prompt_blocks", "Full KV blocks of the prompts routed",
                              value=float(routing.get("prompt_blocks", 0)))
    yield CounterMetricFamily("modserve_router_matched_blocks", "Of those, blocks the chosen replica was last "
                              "sent (a prefix-cache hit the router expects)",
                              value=float(routing.get("matched_blocks", 0)))


# (name, RequestMetrics property, help) of the request phases, as vLLM's v1 metrics define them.
_PHASES = (
    ("queue", "queue_time", "Arrival to when the engine first scheduled the request"),
    ("prefill", "prefill_time", "First scheduled to first token"),
    ("decode", "decode_time", "First token to last token"),
    ("inference", "inference_time", "First scheduled to last token (prefill plus decode)"),
)


def server_metrics(naming: str, model_name: str, max_model_len: int,
                   num_engines: int = 1) -> ServerMetrics | VllmMetrics:
    """The registry for ``metrics_naming``: modserve's families, or vLLM's (vllm_metrics.py)."""
    return VllmMetrics(model_name, max_model_len, num_engines) if naming == "vllm" else ServerMetrics()


class ServerMetrics:
    """The app's registry; also the AsyncEngine's RequestObserver."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.engine_stats = EngineStatsCollector()
        self.registry.register(self.engine_stats)
        self.ttft = Histogram("modserve_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("modserve_inter_token_latency_seconds", "Time between consecutive output tokens",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("modserve_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        # vLLM's request phases (RequestMetrics): observed once the engine marks when it scheduled a request.
        self.phases = [(Histogram(f"modserve_request_{name}_time_seconds", doc, buckets=_LATENCY_BUCKETS,
                                  registry=self.registry), attr) for name, attr, doc in _PHASES]
        self.finished = Counter("modserve_requests_finished", "Requests ended, by finish reason "
                                "(stop, length, abort, error; stalled: a stream its client did not read "
                                "for stream_stall_timeout); per sample when n > 1",
                                ["finish_reason"], registry=self.registry)

    def request_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.inter_token_latencies:
            self.itl.observe(gap)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        for histogram, attr in self.phases:
            if (value := getattr(m, attr)) is not None:
                histogram.observe(value)
        for c in output.outputs:
            self.finished.labels(c.finish_reason or "unknown").inc()

    def request_started(self, request_ids: list[str], params: SamplingParams) -> None:
        pass  # vLLM's naming keeps each request's max_tokens; this one has no use for it

    def request_ended_early(self, reason: str) -> None:
        self.finished.labels(reason).inc()

    def render(self, stats: dict[str, Any]) -> bytes:
        self.engine_stats.stats = stats
        return generate_latest(self.registry)
