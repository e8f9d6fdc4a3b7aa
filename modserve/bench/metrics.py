"""Latency statistics, service-level objectives and goodput, and spreads over repeats.

Times are seconds everywhere in code; reports print milliseconds.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated between order statistics; NaN if empty."""
    return float(np.percentile(values, q)) if len(values) else math.nan


@dataclass(frozen=True, slots=True)
class Summary:
    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Summary":
        if not len(values):
            return cls(math.nan, math.nan, math.nan, math.nan)
        return cls(float(np.mean(values)), percentile(values, 50), percentile(values, 90), percentile(values, 99))

    def ms(self) -> dict[str, float]:
        return {"mean": self.mean * 1e3, "median": self.median * 1e3, "p90": self.p90 * 1e3, "p99": self.p99 * 1e3}


@dataclass(slots=True)
class RequestResult:
    """What one request measured: the client's view of a served or offline request."""

    prompt_len: int
    output_len: int
    ttft: float = math.nan  # request sent -> first token
    e2el: float = math.nan  # request sent -> last token
    itl: list[float] = field(default_factory=list)  # gaps between successive token arrivals
    success: bool = True
    error: str = ""

    @property
    def tpot(self) -> float:
        """Time per output token after the first; 0 for a one-token answer."""
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0


def parse_slos(items: Iterable[str]) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` (milliseconds) -> ``{"ttft": 0.2, "tpot": 0.05}`` (seconds)."""
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {item!r} must be NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"goodput SLO {item!r} must be positive")
        slos[name] = ms / 1e3
    return slos


def meets(result: RequestResult, slos: dict[str, float]) -> bool:
    return result.success and all(getattr(result, name) <= limit for name, limit in slos.items())


def goodput(results: Sequence[RequestResult], slos: dict[str, float], duration: float) -> float:
    """Requests per second that succeeded within every SLO (all of them when ``slos`` is empty)."""
    return sum(meets(r, slos) for r in results) / duration if duration > 0 else math.nan


# -- vLLM's percentile flags and result keys (vllm/benchmarks/serve.py) ---------------------------
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_percentile_metrics(text: str) -> list[str]:
    """``--percentile-metrics ttft,tpot,itl``: the latency metrics whose percentiles are reported."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    bad = [name for name in names if name not in LATENCY_METRICS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of {', '.join(LATENCY_METRICS)}")
    return names


def parse_metric_percentiles(text: str) -> list[float]:
    """``--metric-percentiles 50,90,99``: the percentiles (0..100) reported for those metrics."""
    try:
        values = [float(q) for q in text.split(",") if q.strip()]
    except ValueError:
        values = []
    if not values or not all(0 <= q <= 100 for q in values):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of percentiles between 0 and 100, e.g. 50,90,99")
    return values


def percentile_word(q: float) -> str:
    """A percentile as vLLM's keys spell it: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(q)) if int(q) == q else str(q)


def latency_keys(series: dict[str, Sequence[float]], chosen: Sequence[str],
                 percentiles: Sequence[float]) -> dict[str, float]:
    """vLLM's flat result keys, in ms: ``mean_``, ``median_``, ``std_`` of every metric in
    ``series`` (seconds), and ``p{q}_`` of the ``chosen`` ones: ``p99_ttft_ms``, ...

    NOTE: as vLLM's, an empty series reads as [0] (std is the population's), so the file holds
    numbers, never NaN, which strict JSON readers refuse."""
    out: dict[str, float] = {}
    for name, seconds in series.items():
        values = np.asarray(seconds if len(seconds) else [0.0]) * 1e3
        out[f"mean_{name}_ms"] = float(np.mean(values))
        out[f"median_{name}_ms"] = float(np.median(values))
        out[f"std_{name}_ms"] = float(np.std(values))
        if name in chosen:
            for q in percentiles:
                out[f"p{percentile_word(q)}_{name}_ms"] = float(np.percentile(values, q))
    return out


@dataclass(frozen=True, slots=True)
class Spread:
    """One figure over N repeats: the median and the range."""

    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        if not len(values):
            return cls(math.nan, math.nan, math.nan)
        return cls(float(np.median(values)), float(min(values)), float(max(values)))

    def format(self, digits: int = 1) -> str:
        if self.lo == self.hi:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} [{self.lo:.{digits}f}-{self.hi:.{digits}f}]"


def ratio_spread(numerators: Sequence[float], denominators: Sequence[float]) -> Spread:
    """The ratio per interleaved pair (repeat i of A over repeat i of B), then its spread."""
    return Spread.of([a / b for a, b in zip(numerators, denominators) if b])
