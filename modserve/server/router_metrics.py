"""The disaggregation router's /metrics: its own counters, and every upstream's families with
each sample labelled by where it came from (``role``, ``upstream``), so one scrape of the
router shows them all."""

from __future__ import annotations

from typing import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from modserve.server.router_upstreams import Upstream

# A prefill on a CPU runs from milliseconds (a short prompt) to minutes (a long one).
_PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("modserve_disagg_requests", "Completion and chat requests the router received",
                                ["path"], registry=self.registry)
        self.errors = Counter("modserve_disagg_upstream_errors", "Upstream failures by server and kind (refused, "
                              "timeout, disconnected: mid-answer, unhealthy: /health not 200 before a prefill)",
                              ["role", "kind"], registry=self.registry)
        self.prefill = Histogram("modserve_disagg_prefill_seconds", "The prefill request's round trip",
                                 buckets=_PREFILL_BUCKETS, registry=self.registry)
        self.up = Gauge("modserve_disagg_upstream_up", "1 if the upstream's /metrics answered this scrape",
                        ["role", "upstream"], registry=self.registry)
        self.outstanding = Gauge("modserve_disagg_upstream_outstanding_requests", "Requests this router has sent "
                                 "to the upstream and not yet seen answered (a stream: until its end)",
                                 ["role", "upstream"], registry=self.registry)
        self.routed = Counter("modserve_disagg_routed_requests", "Requests sent to each upstream, by why it was "
                              "chosen: prefix (it held the longest cached prefix, from its KV events) or load",
                              ["role", "upstream", "by"], registry=self.registry)
        self.index_blocks = Gauge("modserve_disagg_kv_index_blocks", "Cached blocks the router's prefix index "
                                  "holds for the upstream, from its KV events", ["role", "upstream"],
                                  registry=self.registry)
        self.event_gaps = Counter("modserve_disagg_kv_event_gaps", "Gaps in an upstream's KV event sequence "
                                  "numbers, by outcome: replayed, or reset (its index emptied, then rebuilt from "
                                  "the events that follow)", ["role", "upstream", "outcome"], registry=self.registry)
        self.event_blocks = Counter("modserve_disagg_kv_event_blocks", "Blocks an upstream's KV events reported "
                                    "stored or removed (evicted)", ["role", "upstream", "event"],
                                    registry=self.registry)

    # The prefix index's reports (router_prefix.IndexObserver).
    def kv_batch(self, upstream: Upstream, indexed: int, stored: int, removed: int) -> None:
        self.index_blocks.labels(upstream.role, upstream.url).set(indexed)
        self.event_blocks.labels(upstream.role, upstream.url, "stored").inc(stored)
        self.event_blocks.labels(upstream.role, upstream.url, "removed").inc(removed)

    def kv_gap(self, upstream: Upstream, outcome: str) -> None:
        self.event_gaps.labels(upstream.role, upstream.url, outcome).inc()

    def render(self, scraped: Iterable[tuple[Upstream, str | None]]) -> bytes:
        """``scraped``: each upstream with its /metrics text, None where it did not answer."""
        families: dict[str, Metric] = {}
        for upstream, text in scraped:
            self.up.labels(upstream.role, upstream.url).set(text is not None)
            for family in text_string_to_metric_families(text or ""):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                                 family.unit))
                tag = {"role": upstream.role, "upstream": upstream.url}
                merged.samples += [s._replace(labels={**s.labels, **tag}) for s in family.samples]
        return generate_latest(_Both(self.registry, families.values()))


class _Both:
    """A collector of the router's registry followed by the upstreams' families."""

    def __init__(self, registry: CollectorRegistry, families: Iterable[Metric]) -> None:
        self.registry, self.families = registry, families

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()
        yield from self.families
