"""A load generator for any OpenAI-compatible server (modserve, vLLM, ...).

Requests leave on a schedule: gaps drawn from a gamma distribution with shape
``burstiness`` and mean ``1 / request_rate`` (burstiness 1 is a Poisson process;
below 1 is burstier, above 1 more regular; an infinite rate sends all at once),
never more than ``max_concurrency`` in flight. Each request streams (SSE), and the
client times every chunk: TTFT is request sent -> first chunk, ITL the gaps between
chunks (a chunk is one token for servers that stream per token), E2E sent -> last.
Output lengths come from the server's ``usage`` (``stream_options.include_usage``);
a server that sends none is credited one token per chunk.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from modserve.bench.metrics import RequestResult, Summary, goodput, latency_keys, percentile_word
from modserve.bench.workloads import BenchRequest


@dataclass(slots=True)
class ServeSettings:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None  # default: the first model /v1/models lists
    request_rate: float = math.inf  # requests/s
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 1
    slos: dict[str, float] = field(default_factory=dict)  # seconds, see metrics.parse_slos
    seed: int = 0
    timeout: float = 600.0
    progress: bool = True
    headers: dict[str, str] = field(default_factory=dict)  # sent with every request, /v1/models too
    percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl")  # vLLM's defaults
    percentiles: Sequence[float] = (99.0,)


def request_headers(items: Sequence[str], api_key: str | None) -> dict[str, str]:
    """vLLM's: ``Authorization: Bearer API_KEY`` (``$OPENAI_API_KEY``) when there is one, then
    each ``KEY=VALUE`` of ``--header``, which replaces a header of the same name."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--header {item!r}: headers are KEY=VALUE")
        # HTTP names are case-insensitive: authorization=... replaces Authorization, not joins it
        headers = {k: v for k, v in headers.items() if k.lower() != key.strip().lower()}
        headers[key.strip()] = value.strip()
    return headers


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds to wait after each request before the next: gamma(shape k, scale 1/(rate k))."""
    if math.isinf(rate):
        return np.zeros(n)
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be positive, got {rate} and {burstiness}")
    return np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)


def _payload(s: ServeSettings, model: str, req: BenchRequest) -> dict[str, Any]:
    common = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
              "stream_options": {"include_usage": True},
              "ignore_eos": True}  # a vLLM extension that modserve shares: exact output lengths
    if s.endpoint.rstrip("/").endswith("chat/completions"):
        if req.prompt is None:
            raise ValueError("chat endpoints take text prompts; this workload has token ids only")
        return {**common, "messages": [{"role": "user", "content": req.prompt}]}
    return {**common, "prompt": req.prompt if req.prompt is not None else req.prompt_token_ids}


async def _send(client: Any, s: ServeSettings, model: str, req: BenchRequest) -> RequestResult:
    result = RequestResult(prompt_len=req.prompt_len or 0, output_len=0)
    times: list[float] = []
    usage: dict[str, Any] | None = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", s.base_url.rstrip("/") + s.endpoint, json=_payload(s, model, req)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                return _failed(result, f"HTTP {resp.status_code}: {body[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices"):
                    times.append(time.perf_counter())
                usage = chunk.get("usage") or usage
    except Exception as e:  # a failed request is a result, not the end of the benchmark
        return _failed(result, f"{type(e).__name__}: {e}")
    if not times:
        return _failed(result, "the stream carried no tokens")
    result.ttft = times[0] - start
    result.e2el = times[-1] - start
    result.itl = [b - a for a, b in zip(times, times[1:])]
    result.output_len = int(usage["completion_tokens"]) if usage else len(times)
    if usage and usage.get("prompt_tokens"):
        result.prompt_len = int(usage["prompt_tokens"])
    return result


def _failed(result: RequestResult, error: str) -> RequestResult:
    result.success, result.error = False, error
    return result


async def first_model(client: Any, base_url: str) -> str:
    resp = await client.get(base_url.rstrip("/") + "/v1/models")
    if resp.status_code == 401:
        raise RuntimeError("/v1/models: HTTP 401: the server wants an API key: set OPENAI_API_KEY")
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def _run(s: ServeSettings, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    import httpx
    from tqdm import tqdm

    limit = s.max_concurrency or len(requests) or 1
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=s.timeout, limits=limits, headers=s.headers) as client:
        model = s.model or await first_model(client, s.base_url)
        for req in requests[: s.num_warmups]:
            warm = await _send(client, s, model, req)
            if not warm.success:
                hint = " (the server wants an API key: set OPENAI_API_KEY)" if "HTTP 401" in warm.error else ""
                raise RuntimeError(f"warm-up request failed: {warm.error}{hint}")
        gate = asyncio.Semaphore(limit)
        bar = tqdm(total=len(requests), desc="Requests", unit="req", disable=not s.progress)

        async def limited(req: BenchRequest) -> RequestResult:
            async with gate:
                result = await _send(client, s, model, req)
            bar.update(1)
            return result

        tasks = []
        start = time.perf_counter()
        for req, gap in zip(requests, arrival_gaps(len(requests), s.request_rate, s.burstiness, s.seed)):
            tasks.append(asyncio.create_task(limited(req)))
            if gap:
                await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return report(s, model, results, duration)


def run(settings: ServeSettings, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    """Send the workload once; the result as a JSON-ready dict."""
    return asyncio.run(_run(settings, requests))


def report(s: ServeSettings, model: str, results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    figures = {
        "base_url": s.base_url, "endpoint": s.endpoint, "model": model,
        "request_rate": None if math.isinf(s.request_rate) else s.request_rate,
        "burstiness": s.burstiness, "max_concurrency": s.max_concurrency,
        "num_prompts": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "slos_ms": {k: v * 1e3 for k, v in s.slos.items()},
        "goodput": goodput(results, s.slos, duration) if s.slos else None,
    }
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.output_len > 1],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.e2el for r in ok]}
    for name, values in series.items():
        figures[f"{name}_ms"] = Summary.of(values).ms()
    # vLLM's flat keys beside modserve's own, for scripts written against `vllm bench serve`
    figures.update(duration=duration, request_goodput=figures["goodput"])
    figures.update(latency_keys(series, s.percentile_metrics, s.percentiles))
    figures["requests"] = [{"prompt_len": r.prompt_len, "output_len": r.output_len, "ttft": r.ttft,
                            "e2el": r.e2el, "itl": r.itl, "error": r.error} for r in results]
    return figures


def headline(figures: dict[str, Any], chosen: Sequence[str] = ("ttft", "tpot", "itl"),
             percentiles: Sequence[float] = (99.0,)) -> dict[str, float]:
    """The scalar figures printed per run and summarised over repeats: throughputs, then mean,
    median and the ``percentiles`` of the ``chosen`` metrics (vLLM's ``--percentile-metrics``)."""
    out = {"req/s": figures["request_throughput"], "output tok/s": figures["output_throughput"],
           "total tok/s": figures["total_token_throughput"]}
    if figures["goodput"] is not None:
        out["goodput req/s"] = figures["goodput"]
    for name in chosen:
        for stat in ("mean", "median", *(f"p{percentile_word(q)}" for q in percentiles)):
            out[f"{name.upper()} {stat} ms"] = figures[f"{stat}_{name}_ms"]
    return out


VLLM_COUNTS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
               "request_throughput", "request_goodput", "output_throughput", "total_token_throughput")


def vllm_result(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's flat keys for the top of a result file: one run's own; over repeats, the median
    of each, as the printed table (each run in ``runs`` keeps its own)."""
    first = runs[0]
    keys = [k for k in first if k in VLLM_COUNTS or (k.endswith("_ms") and isinstance(first[k], float))]
    if len(runs) == 1:
        return {k: first[k] for k in keys}
    return {k: None if first[k] is None else float(np.median([r[k] for r in runs])) for k in keys}
