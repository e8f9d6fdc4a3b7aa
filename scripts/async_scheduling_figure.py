"""Decode step time and ITL with async scheduling off and on, interleaved.

For each batch size N: N requests (distinct 128-token prompts, one stop string that never
matches, so every step's text is searched as a server's would be) are prefilled, then
``--steps`` decode steps are timed; each request's inter-token latencies are the gaps between
the outputs in which its token count grew. The two engines (off, on) run one after the other
at each size and repeat, so a machine shared with other work loads both alike.

    .venv/bin/python scripts/async_scheduling_figure.py --model SMALL --batch-sizes 1 16 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def run(engine, n: int, steps: int, tag: str) -> tuple[list[float], list[float]]:
    """Step times and ITLs (ms) of ``steps`` decode steps of ``n`` sequences."""
    from modserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True, stop=["\x00never\x00"])
    for i in range(n):
        engine.add_request(f"{tag}-{i}", list(range(100 + i, 228 + i)), params)
    for _ in range(-(-n * 128 // 2048) + 2):  # the prefills and the first decode (and its output, async)
        engine.step()
    counts, last, step_ms, itl = {}, {}, [], []
    for _ in range(steps):
        start = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        step_ms.append((now - start) * 1e3)
        for out in outs:
            k = len(out.outputs[0].token_ids)
            if k > counts.get(out.request_id, 0):
                if out.request_id in last:
                    itl.append((now - last[out.request_id]) * 1e3)
                counts[out.request_id], last[out.request_id] = k, now
    while engine.has_unfinished_requests():
        engine.step()
    return step_ms, itl


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--json", help="write the raw figures here")
    args = ap.parse_args()
    from modserve import LLM
    from modserve.bench.report import hardware_line

    extra = {"num_threads": args.num_threads} if args.num_threads else {}
    llms = {mode: LLM(args.model, progress=False, num_kv_blocks=1024, async_scheduling=mode, **extra)
            for mode in (False, True)}
    engines = {mode: llm.engine for mode, llm in llms.items()}
    raw: dict[str, dict[str, list[float]]] = {}
    for n in args.batch_sizes:
        for r in range(args.repeats):
            for mode in ((False, True) if r % 2 == 0 else (True, False)):  # alternate which goes first
                step_ms, itl = run(engines[mode], n, args.steps, f"{n}-{r}-{mode}")
                key = f"{n}/{'on' if mode else 'off'}"
                raw.setdefault(key, {"step_ms": [], "itl_ms": []})
                raw[key]["step_ms"] += step_ms
                raw[key]["itl_ms"] += itl
    print(f"{hardware_line()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| sequences | async | step ms p50 | ITL ms p50 | ITL ms p99 |\n|---|---|---|---|---|")
    for key, v in raw.items():
        n, mode = key.split("/")
        print(f"| {n} | {mode} | {statistics.median(v['step_ms']):.2f} | {pct(v['itl_ms'], 0.5):.2f} | "
              f"{pct(v['itl_ms'], 0.99):.2f} |")
    for llm in llms.values():
        llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
