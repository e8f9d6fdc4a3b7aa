"""Hash-chain (kv_allocator paged) vs radix-tree (radix) prefix caching on four workloads.

Steps an engine by hand per (workload, allocator, KV budget) and records the prefix-cache
hit tokens (of the prompt tokens queried), the steps, and the scheduler's time per step
(its ``step`` and ``update``: admission with the prefix match, allocation, publication).
Prints a markdown table and writes a plot.

    python scripts/prefix_cache_ab.py [--model DIR] [--blocks 2048 96] [--plot docs/figures/prefix-cache-ab.png]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from types import SimpleNamespace

from modserve import LLM, SamplingParams
from modserve.bench.workloads import load_workload, tokenize
from modserve.testing import cached_checkpoint

WORKLOADS = {  # the flags of `modserve compare` for each (docs/prefix-caching.md)
    "shared system prompt": dict(workload="random", prefix_len=256, input_len=32),
    "multi-turn chat": dict(workload="multi-turn", prefix_len=64, input_len=32, num_turns=4),
    "branching few-shot": dict(workload="few-shot", prefix_len=32, suffix_len=64, input_len=16, num_shots=3,
                               branching=2),
    "no sharing": dict(workload="random", input_len=256),
}
DEFAULTS = dict(num_prompts=32, output_len=16, range_ratio=0.0, prefix_len=0, suffix_len=64, num_prefixes=4,
                num_turns=4, num_shots=3, branching=2, workload_seed=0, workload_path=None)


def timed(fn, into: list[float]):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)
    return wrapper


def run(model: str, allocator: str, blocks: int, requests) -> dict[str, float]:
    llm = LLM(model, dtype="float32", num_kv_blocks=blocks, max_model_len=1280, kv_allocator=allocator,
              num_threads=2, progress=False)
    eng = llm.engine
    step_s: list[float] = []
    update_s: list[float] = []
    # NOTE: instance attributes shadow the methods for this engine only: the measurement
    # needs the scheduler's own time, which no counter keeps.
    eng.scheduler.step = timed(eng.scheduler.step, step_s)
    eng.scheduler.update = timed(eng.scheduler.update, update_s)
    for i, r in enumerate(requests):
        eng.add_request(str(i), r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=r.output_len,
                                                                    ignore_eos=True))
    start = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    wall = time.perf_counter() - start
    stats = eng.allocator.stats()
    assert eng.allocator.num_free_blocks() == blocks  # every block back
    return {"hit": stats["prefix_hit_tokens"] / max(1, stats["prefix_queried_tokens"]),
            "hit tokens": stats["prefix_hit_tokens"], "evictions": stats["evictions"], "steps": len(step_s),
            "sched us": 1e6 * statistics.median(a + b for a, b in zip(step_s, update_s)), "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="default: the tiny random-weight Llama")
    ap.add_argument("--blocks", type=int, nargs="+", default=[2048, 96], help="KV budgets (16-token blocks)")
    ap.add_argument("--plot", default="docs/figures/prefix-cache-ab.png")
    args = ap.parse_args()
    model = args.model or str(cached_checkpoint("llama"))
    tok = LLM(model, dtype="float32", num_kv_blocks=256, max_model_len=1280, progress=False).get_tokenizer()
    results: dict[tuple[str, str, int], dict[str, float]] = {}
    print("| workload | KV blocks | allocator | prefix hit | hit tokens | evictions | steps | scheduler us/step |")
    print("|---|---|---|---|---|---|---|---|")
    for name, flags in WORKLOADS.items():
        requests = tokenize(load_workload(SimpleNamespace(**{**DEFAULTS, **flags}), tok), tok)
        for blocks in args.blocks:
            for allocator in ("paged", "radix"):
                r = results[name, allocator, blocks] = run(model, allocator, blocks, requests)
                print(f"| {name} | {blocks} | {allocator} | {r['hit']:.1%} | {r['hit tokens']} | {r['evictions']} "
                      f"| {r['steps']} | {r['sched us']:.0f} |", flush=True)
    plot(results, args.blocks, args.plot, model)


def plot(results, budgets: list[int], path: str, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(WORKLOADS)
    fig, (ax_hit, ax_us) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / (2 * len(budgets))
    for j, (blocks, allocator) in enumerate((b, a) for b in budgets for a in ("paged", "radix")):
        xs = [i + (j - len(budgets) + 0.5) * width for i in range(len(names))]
        label = f"{'hash chain' if allocator == 'paged' else 'radix'}, {blocks} blocks"
        hatch = "//" if blocks != budgets[0] else None
        color = "tab:blue" if allocator == "paged" else "tab:orange"
        ax_hit.bar(xs, [100 * results[n, allocator, blocks]["hit"] for n in names], width, label=label,
                   color=color, hatch=hatch, edgecolor="black")
        ax_us.bar(xs, [results[n, allocator, blocks]["sched us"] for n in names], width, label=label,
                  color=color, hatch=hatch, edgecolor="black")
    for ax, ylabel in ((ax_hit, "prompt tokens from the prefix cache (%)"), (ax_us, "scheduler time per step (us)")):
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_ylabel(ylabel)
    ax_hit.legend(fontsize=8)
    fig.suptitle(f"kv_allocator paged (hash chain) vs radix: {model.rstrip('/').rsplit('/', 1)[-1]}, float32, "
                 f"{platform.machine()} CPU, 2 threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
