"""Time a decode step of N sequences: N requests prefilled, then 30 steps timed.

Where the bf16 few-row kernel hands over to float32 GEMMs shows here: the step time for
each batch size, and the ops that took the most of it (torch profiler, 10 more steps).

    .venv/bin/python scripts/decode_step_time.py --model build/ref-small --batch-sizes 1 4 8 9 12 16 24
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--native-decode", choices=["on", "off"], default="on",
                    help="the cpu platform's native decode step (off: the compiled forward)")
    ap.add_argument("--quantization", help="a quantizer's name (int8, ...)")
    ap.add_argument("--json", help="write {sequences: ms per step} here")
    ap.add_argument("--median", action="store_true",
                    help="ms per step: the median step, not the mean (steps preempted on a shared machine fall out)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: the process's CPU time per step, which leaves out time slices other jobs take "
                         "(meaningful with OMP_NUM_THREADS=1)")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from modserve import LLM, SamplingParams

    platform = {"name": "cpu", "options": {"native_decode": args.native_decode == "on"}}
    extra = {"quantization": args.quantization} if args.quantization else {}
    engine = LLM(args.model, progress=False, platform=platform, **extra).engine
    print("| sequences | ms per step | tokens/s | top ops (ms per step) |\n|---|---|---|---|")
    times: dict[int, float] = {}
    for n in args.batch_sizes:
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 20, ignore_eos=True)
        for i in range(n):  # 150-token prompts, distinct so nothing is shared
            engine.add_request(f"{n}-{i}", list(range(100 + i, 250 + i)), params)
        # prefill (a step per 2048 tokens, the default max_num_batched_tokens) and the first
        # decode: with fewer, 64 sequences timed their last prefill step among the decodes
        for _ in range(-(-n * 150 // 2048) + 1):
            engine.step()
        steps = []
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        for _ in range(args.steps):
            start = clock()
            engine.step()
            steps.append(clock() - start)
        step = statistics.median(steps) if args.median else sum(steps) / len(steps)
        times[n] = step * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine.step()
        top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:3]
        ops = "; ".join(f"{e.key[:40]} {e.self_cpu_time_total / 5e3:.1f}" for e in top)
        print(f"| {n} | {step * 1e3:.1f} | {n / step:.0f} | {ops} |", flush=True)
        while engine.has_unfinished_requests():
            engine.step()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(times, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
