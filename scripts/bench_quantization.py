"""The speed table of docs/quantization.md: every method against the float model, interleaved.

    .venv/bin/python scripts/bench_quantization.py [--threads 2] [--repeats 3]

`modserve bench latency` and `modserve bench throughput` measure one config per process;
on a shared machine the load drifts between processes more than the methods differ. This
loads every method once (the "small" random-weight Llama, 88M parameters) and runs the
same measurements (modserve.bench.offline) round-robin: float32, int8, ..., float32, int8, ...
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from modserve import LLM
from modserve.bench.offline import EngineRunner, interleave
from modserve.bench.workloads import BenchRequest, token_pool
from modserve.testing import cached_checkpoint, cached_quantized_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    small = str(cached_checkpoint("llama", "small"))
    q = lambda *a, **kw: str(cached_quantized_checkpoint(*a, preset="small", group_size=128, **kw))  # noqa: E731
    methods = {
        "float32": dict(model=small), "bfloat16": dict(model=small, dtype="bfloat16"),
        "int8": dict(model=small, quantization="int8"), "fp8": dict(model=small, quantization="fp8"),
        "awq (g128)": dict(model=q("awq")), "gptq 4-bit (g128)": dict(model=q("gptq")),
        "gptq 8-bit (g128)": dict(model=q("gptq", bits=8)),
        "float32 + fp8 KV": dict(model=small, kv_cache_dtype="fp8_e4m3"),
    }
    runners = [EngineRunner(LLM(**{"dtype": "float32", "num_kv_blocks": 256, "progress": False, **cfg}), name)
               for name, cfg in methods.items()]
    pool = token_pool(runners[0].llm.get_tokenizer())
    rng = np.random.default_rng(0)
    prompts = [rng.choice(pool, args.input_len).tolist() for _ in range(args.num_prompts)]
    single = interleave(runners, [BenchRequest(None, prompts[0], args.output_len)], args.repeats)
    batch = interleave(runners, [BenchRequest(None, p, args.output_len) for p in prompts], args.repeats)

    def med(values: list[float]) -> str:
        return f"{statistics.median(values):,.0f} [{min(values):,.0f}-{max(values):,.0f}]"

    print(f"llama-small, {args.threads} threads; single stream: {args.input_len} prompt + {args.output_len} "
          f"output tokens; offline: {args.num_prompts} such requests at once; median [min-max] of "
          f"{args.repeats} interleaved runs")
    print("| method | weights | TTFT ms | TPOT ms | decode vs float32 | offline tok/s (in + out) | vs float32 |")
    print("|---|---|---|---|---|---|---|")
    base_tpot = statistics.median(r.results[0].tpot for r in single["float32"])
    base_tput = statistics.median(r.total_tok_s for r in batch["float32"])
    for runner in runners:
        s, b = single[runner.name], batch[runner.name]
        tpot = [r.results[0].tpot * 1e3 for r in s]
        tput = [r.total_tok_s for r in b]
        print(f"| {runner.name} | {runner.llm.engine.runner.weight_bytes / 2**20:.0f} MiB "
              f"| {med([r.results[0].ttft * 1e3 for r in s])} | {med(tpot)} "
              f"| {base_tpot * 1e3 / statistics.median(tpot):.2f}x | {med(tput)} "
              f"| {statistics.median(tput) / base_tput:.2f}x |")


if __name__ == "__main__":
    main()
