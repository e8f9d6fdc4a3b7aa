"""Decode step time of one model under several parallel layouts, interleaved over repeats.

Each layout (``TPxPP``, ``/mN`` for N pipeline micro-batches, ``tN`` for N threads per rank)
gets an engine; N sequences are prefilled, then ``--steps`` decode steps are timed. The
layouts take turns each repeat (this machine is shared: a burst of other work then lands on
every layout, not one), and the table gives each one's median, its ratio to the first layout,
and for pipeline layouts the bubble implied by the time: ``1 - t(1 rank) / (pp x t)``, every
idle or communicating moment of a stage counted, against a perfect split of the layers.

    .venv/bin/python scripts/parallel_step_time.py --model build/ref-small \\
        --layouts 1x1/t1 1x1/t2 2x1/t1 1x2/m1/t1 1x2/m2/t1 1x2/m4/t1 --batch-size 16
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    micro_batches: int | None
    threads: int

    @classmethod
    def parse(cls, text: str) -> "Layout":
        shape, *mods = text.split("/")
        tp, pp = (int(x) for x in shape.split("x"))
        micro = next((int(m[1:]) for m in mods if m.startswith("m")), None)
        threads = next((int(m[1:]) for m in mods if m.startswith("t")), 1)
        return cls(tp, pp, micro, threads)

    def __str__(self) -> str:
        micro = f", {self.micro_batches} micro-batches" if self.pp > 1 else ""
        return f"TP={self.tp} PP={self.pp}{micro}, {self.threads} thread{'s' * (self.threads > 1)}/rank"


def time_layout(model: str, layout: Layout, batch: int, steps: int, prompt_len: int, phase: str) -> float:
    """Seconds per decode step of ``batch`` sequences, or (``phase`` prefill) per prefill step of
    ``batch`` prompts of ``prompt_len`` tokens (one step each, max_num_batched_tokens allowing)."""
    from modserve import LLM, SamplingParams

    llm = LLM(model, progress=False, num_threads=layout.threads, tensor_parallel_size=layout.tp,
              pipeline_parallel_size=layout.pp, pipeline_micro_batches=layout.micro_batches, compile="off",
              max_num_batched_tokens=max(2048, batch * prompt_len))
    try:
        engine = llm.engine
        if phase == "prefill":
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            timed = []
            for r in range(steps + 1):  # each round a fresh batch of distinct prompts: one prefill step
                for i in range(batch):
                    engine.add_request(f"{r}-{i}", [(7 * i + 13 * r + j) % 4000 + 3 for j in range(prompt_len)],
                                       params)
                start = time.perf_counter()
                while engine.has_unfinished_requests():
                    engine.step()
                timed.append(time.perf_counter() - start)
            return statistics.median(timed[1:])
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(batch):  # distinct prompts: nothing shared through the prefix cache
            engine.add_request(str(i), [(7 * i + j) % 4000 + 3 for j in range(prompt_len)], params)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or \
                engine.scheduler.waiting:
            engine.step()  # the prefills (and the first decodes)
        for _ in range(3):
            engine.step()  # warm
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        return (time.perf_counter() - start) / steps
    finally:
        llm.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--layouts", nargs="+", default=["1x1/t1", "1x1/t2", "2x1/t1", "1x2/m1/t1", "1x2/m2/t1"])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--phase", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--json", default="build/parallel-step-time.json")
    ap.add_argument("--plot", default=None, help="a png of the medians")
    args = ap.parse_args()
    layouts = [Layout.parse(t) for t in args.layouts]
    times: dict[str, list[float]] = {str(lay): [] for lay in layouts}
    for r in range(args.repeats):
        for lay in layouts:
            t = time_layout(args.model, lay, args.batch_size, args.steps, args.prompt_len, args.phase)
            times[str(lay)].append(t)
            print(f"[repeat {r + 1}/{args.repeats}] {lay}: {t * 1e3:.1f} ms per step", flush=True)
    base = statistics.median(times[str(layouts[0])])
    one_rank = {lay.threads: statistics.median(times[str(lay)]) for lay in layouts if lay.tp * lay.pp == 1}
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    what = f"{args.steps} decode steps" if args.phase == "decode" else f"{args.steps} prefills of {args.prompt_len} tokens"
    print(f"\n{Path(args.model).name}, batch {args.batch_size}, {machine}, load {os.getloadavg()[0]:.1f}; "
          f"median of {args.repeats}, {what} each")
    print("| layout | ms per step (median) | range | vs first | pipeline bubble |\n|---|---|---|---|---|")
    rows = []
    for lay in layouts:
        ts = times[str(lay)]
        med = statistics.median(ts)
        bubble = ""
        if lay.pp > 1 and lay.threads in one_rank:
            bubble = f"{1 - one_rank[lay.threads] / (lay.pp * med):.0%}"
        print(f"| {lay} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f} | {base / med:.2f}x | {bubble} |")
        rows.append({"layout": str(lay), "tp": lay.tp, "pp": lay.pp, "micro_batches": lay.micro_batches,
                     "threads": lay.threads, "seconds": ts, "median": med, "bubble": bubble or None})
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"model": args.model, "phase": args.phase, "prompt_len": args.prompt_len,
                                           "batch_size": args.batch_size, "machine": machine,
                                           "date": datetime.date.today().isoformat(), "rows": rows}, indent=1))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.barh([r["layout"] for r in rows][::-1], [r["median"] * 1e3 for r in rows][::-1])
        ax.set_xlabel(f"ms per {args.phase} step (median)")
        step = f"decode step of {args.batch_size} sequences" if args.phase == "decode" else \
            f"prefill of {args.batch_size} x {args.prompt_len} tokens"
        ax.set_title(f"{Path(args.model).name}: {step} by layout\n"
                     f"{machine}, gloo, {datetime.date.today().isoformat()}", fontsize=10)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
