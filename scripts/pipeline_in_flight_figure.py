"""PP=2 decode throughput with batches in flight against one step at a time, interleaved.

Two engines of ``pipeline_parallel_size=2`` (one thread per rank) live side by side, each in
a process of its own (one process group each): ``pipeline_in_flight`` on, and off (today's
micro-batching within a step, which leaves a decode step whole). For each batch size N and
repeat, each engine in turn gets N requests (distinct ``--input-len``-token prompts,
``--output-len`` greedy tokens, EOS ignored): the prefills run first, then the decode phase
is timed (tokens after each request's first / wall seconds), with each stage's idle fraction
over it (1 - wall time inside its layers / the phase's wall time). The engine idle meanwhile
waits in a blocking receive, so the two alternate on the cores.

    .venv/bin/python scripts/pipeline_in_flight_figure.py --model SMALL --batch-sizes 16 32 --repeats 3 \\
        --plot docs/figures/pipeline_in_flight.png
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time


def engine_process(conn, model: str, in_flight: bool, threads: int, max_model_len: int) -> None:
    """One engine; each (n, input_len, output_len) received is answered with one run's figures."""
    from modserve import LLM, SamplingParams
    from modserve.bench.bubble import StageClock, idle_fractions

    llm = LLM(model, pipeline_parallel_size=2, pipeline_in_flight=in_flight, num_threads=threads,
              max_model_len=max_model_len, max_num_seqs=64, progress=False)
    eng, runs = llm.engine, 0
    conn.send("ready")
    while (job := conn.recv()) is not None:
        n, input_len, output_len = job
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        for i in range(n):
            eng.add_request(f"r{runs}-{i}", [100 + (i * 7 + k) % 3000 for k in range(input_len)], params)
        runs += 1
        counts: dict[str, int] = {}
        while len(counts) < n or min(counts.values()) < 1:  # the prefills, up to every first token
            for out in eng.step():
                counts[out.request_id] = len(out.outputs[0].token_ids)
        first = sum(counts.values())
        start, clock = time.perf_counter(), StageClock.read(llm)
        while eng.has_unfinished_requests():
            for out in eng.step():
                counts[out.request_id] = len(out.outputs[0].token_ids)
        wall = time.perf_counter() - start
        idle = idle_fractions(clock, StageClock.read(llm), 1)
        conn.send({"tok_s": (sum(counts.values()) - first) / wall, "idle": idle, "wall": wall})
    llm.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads per rank (stage)")
    ap.add_argument("--json", help="write the raw figures here")
    ap.add_argument("--plot", help="write a bar chart (PNG) here")
    args = ap.parse_args()

    ctx = mp.get_context("spawn")
    modes = {"in flight": True, "one step at a time": False}
    pipes = {}
    for name, on in modes.items():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=engine_process, args=(child, args.model, on, args.num_threads,
                                                        args.input_len + args.output_len + 16))
        proc.start()
        pipes[name] = (parent, proc)
    for parent, _ in pipes.values():
        assert parent.recv() == "ready"
    results: dict[str, dict[int, list[dict]]] = {m: {n: [] for n in args.batch_sizes} for m in modes}
    try:
        for _ in range(args.repeats):
            for n in args.batch_sizes:
                for name, (parent, _) in pipes.items():  # alternately: a load falls on both alike
                    parent.send((n, args.input_len, args.output_len))
                    results[name][n].append(parent.recv())
    finally:
        for parent, proc in pipes.values():
            parent.send(None)
            proc.join(120)

    cpu = cpu_name()
    print(f"model {args.model}; {cpu}; PP=2, {args.num_threads} thread(s) per stage; "
          f"{args.input_len} in / {args.output_len} out; median of {args.repeats} interleaved repeats")
    print("| sequences | mode | decode tok/s | idle stage 0 | idle stage 1 |")
    print("|---|---|---|---|---|")
    summary = {}
    for n in args.batch_sizes:
        for name in modes:
            runs = results[name][n]
            rate = statistics.median(r["tok_s"] for r in runs)
            idle = [statistics.median(r["idle"][s] for r in runs) for s in range(2)]
            summary[(name, n)] = (rate, idle)
            print(f"| {n} | {name} | {rate:.1f} | {idle[0]:.0%} | {idle[1]:.0%} |")
    for n in args.batch_sizes:
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(results["in flight"][n], results["one step at a time"][n])]
        print(f"{n} sequences: in flight / one step at a time = {statistics.median(ratios):.2f}x "
              f"[{min(ratios):.2f}-{max(ratios):.2f}] (paired repeats)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "cpu": cpu, "results": results}, f, indent=1)
    if args.plot:
        plot(args, summary, modes, cpu)
    return 0


def plot(args: argparse.Namespace, summary: dict, modes: dict, cpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for k, name in enumerate(modes):
        xs = [i + (k - 0.5) * width for i in range(len(args.batch_sizes))]
        rates = [summary[(name, n)][0] for n in args.batch_sizes]
        bars = ax.bar(xs, rates, width, label=name)
        for bar, n in zip(bars, args.batch_sizes):
            idle = summary[(name, n)][1]
            ax.annotate(f"idle {idle[0]:.0%}/{idle[1]:.0%}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(args.batch_sizes)), [f"{n} sequences" for n in args.batch_sizes])
    ax.set_ylabel("decode tok/s")
    ax.legend(loc="lower right")
    name = args.model.rstrip("/").rsplit("/", 1)[-1]
    ax.set_title(f"PP=2 decode, {args.input_len} in / {args.output_len} out: {name}\n{cpu}, {time.strftime('%Y-%m-%d')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"plot: {args.plot}")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        return f"{mp.cpu_count()}-core {model}"
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


if __name__ == "__main__":
    sys.exit(main())
