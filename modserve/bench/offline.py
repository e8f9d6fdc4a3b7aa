"""Offline benchmarks through ``LLM.generate``: batch throughput and single-stream latency.

A runner is anything with ``name`` and ``run(requests) -> Run``; modserve's is
:class:`EngineRunner`, the transformers baseline lives in :mod:`.hf_baseline`.
Runners are interleaved (A B A B ...) so that machine drift hits them alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from modserve.bench.metrics import RequestResult
from modserve.bench.workloads import BenchRequest


@dataclass(slots=True)
class Run:
    """One timed pass of a workload."""

    wall: float
    prompt_tokens: int
    output_tokens: int
    results: list[RequestResult] = field(default_factory=list)  # per request, when the runner times them
    token_ids: list[list[int]] = field(default_factory=list)  # each request's generated tokens

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall

    @property
    def req_s(self) -> float:
        return len(self.token_ids) / self.wall

    def figures(self) -> dict[str, float]:
        return {"total tok/s": self.total_tok_s, "output tok/s": self.output_tok_s,
                "req/s": self.req_s, "wall s": self.wall}


class Runner(Protocol):
    name: str

    def run(self, requests: Sequence[BenchRequest]) -> Run: ...


class EngineRunner:
    """modserve: every request submitted at once, greedy, exactly ``output_len`` tokens each,
    from an empty prefix cache. ``n`` above 1 (vLLM's ``--n``) samples that many sequences per
    prompt at temperature 1, as vLLM's benchmarks do: n greedy copies would all be the same."""

    def __init__(self, llm, name: str = "modserve", n: int = 1) -> None:
        self.llm = llm
        self.name = name
        self.n = n

    def params(self, output_len: int) -> Any:
        from modserve import SamplingParams

        if self.n == 1:
            return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        return SamplingParams(n=self.n, temperature=1.0, top_p=1.0, max_tokens=output_len, ignore_eos=True)

    def run(self, requests: Sequence[BenchRequest]) -> Run:
        params = [self.params(r.output_len) for r in requests]
        self.llm.reset_prefix_cache()  # a repeat of the workload must not hit the last run's prompts
        start = time.perf_counter()
        outs = self.llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
        wall = time.perf_counter() - start
        results = []
        for req, out in zip(requests, outs):
            m = out.metrics
            results.append(RequestResult(
                prompt_len=len(req.prompt_token_ids), output_len=len(out.outputs[0].token_ids),
                ttft=m.ttft, e2el=m.token_times[-1] - m.arrival_time, itl=m.inter_token_latencies))
        return Run(wall, sum(len(r.prompt_token_ids) for r in requests),
                   sum(len(c.token_ids) for o in outs for c in o.outputs), results,  # every one of n samples
                   [list(o.outputs[0].token_ids) for o in outs])


def warm_up(runners: Sequence[Runner], requests: Sequence[BenchRequest], times: int) -> None:
    """Untimed passes over a few short requests: first calls pay for lazy imports and allocations."""
    few = [BenchRequest(r.prompt, r.prompt_token_ids, min(r.output_len, 4)) for r in requests[:4]]
    for _ in range(times):
        for runner in runners:
            runner.run(few)


def interleave(runners: Sequence[Runner], requests: Sequence[BenchRequest], repeats: int,
               warmups: int = 1, progress: bool = True) -> dict[str, list[Run]]:
    """Repeat the workload on every runner in turn (A B A B ...); the runs per runner name."""
    from tqdm import tqdm

    warm_up(runners, requests, warmups)
    runs: dict[str, list[Run]] = {r.name: [] for r in runners}
    with tqdm(total=repeats * len(runners), desc="Benchmark", unit="run", disable=not progress) as bar:
        for _ in range(repeats):
            for runner in runners:
                runs[runner.name].append(runner.run(requests))
                bar.update(1)
    return runs


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> tuple[float, list[int]]:
    """Greedy agreement: the fraction of requests whose tokens match exactly, and for each
    request that differs, the position of its first differing token."""
    diverged = []
    for x, y in zip(a, b):
        if list(x) != list(y):
            n = min(len(x), len(y))
            diverged.append(next((i for i in range(n) if x[i] != y[i]), n))
    return (1.0 - len(diverged) / len(a)) if a else 1.0, diverged


@dataclass(slots=True)
class LatencyRun:
    ttft: float
    tpot: float
    e2el: float
    batch: int = 1  # requests generated together (vLLM's --batch-size)

    def figures(self) -> dict[str, float]:
        return {"TTFT ms": self.ttft * 1e3, "TPOT ms": self.tpot * 1e3, "E2E ms": self.e2el * 1e3,
                "decode tok/s": self.batch / self.tpot if self.tpot else float("nan")}

    @classmethod
    def of_batch(cls, results: Sequence[RequestResult]) -> "LatencyRun":
        """A batch's: TTFT when its last request had its first token, E2E when its last token
        came (vLLM's latency of the batch), TPOT the requests' mean; one request's own figures."""
        return cls(max(r.ttft for r in results), float(np.mean([r.tpot for r in results])),
                   max(r.e2el for r in results), len(results))


def vllm_latency_keys(runs: Sequence[LatencyRun]) -> dict[str, Any]:
    """``vllm bench latency``'s result keys (seconds): each run's latency (E2E of its batch),
    their mean, std and percentiles 10, 25, 50, 75, 90, 99."""
    latencies = np.array([r.e2el for r in runs])
    percentages = [10, 25, 50, 75, 90, 99]
    return {"avg_latency": float(latencies.mean()), "std_latency": float(latencies.std()),
            "latencies": latencies.tolist(),
            "percentiles": dict(zip(map(str, percentages), np.percentile(latencies, percentages).tolist()))}


def single_stream(llm, input_len: int, output_len: int, repeats: int, warmups: int = 1,
                  seed: int = 0, baselines: Sequence[Any] = (), batch_size: int = 1) -> dict[str, list[LatencyRun]]:
    """One request at a time (``batch_size`` at once, vLLM's ``--batch-size``): ``input_len``
    random prompt tokens each, exactly ``output_len`` out. ``baselines`` (runners with
    ``latency(request) -> LatencyRun``, single requests only) take their turn after modserve in
    every repeat (A B A B ...); the runs per runner name."""
    from modserve.bench.workloads import token_pool

    pool = token_pool(llm.get_tokenizer())
    rng = np.random.default_rng(seed)
    batch = [BenchRequest(None, rng.choice(pool, input_len).tolist(), output_len) for _ in range(batch_size)]
    runner = EngineRunner(llm)
    warm_up([runner, *baselines], batch, warmups)
    runs: dict[str, list[LatencyRun]] = {runner.name: [], **{b.name: [] for b in baselines}}
    for _ in range(repeats):
        runs[runner.name].append(LatencyRun.of_batch(runner.run(batch).results))
        for baseline in baselines:
            runs[baseline.name].append(baseline.latency(batch[0]))
    return runs
