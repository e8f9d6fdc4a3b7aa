"""Time a decode step of 16 sequences under 0, 1 and 4 distinct LoRA adapters against the base model.

Random rank-16 adapters on every projection of a ~88M Llama (``small`` preset, float32), the
updates added by each LoRA kernel named (the cpu platform's ``lora_kernel`` option: ``native``,
its C++ op, or ``torch``, the reference). The engines are alive together and stepped in turns,
5 steps each per round, so load from other processes falls on all of them alike. Each row is
the step's CPU time on the stepping thread, fastest and median, the CPU time of its calls to the
LoRA kernel (median), and the median wall time: on
one thread by default (``--threads``), where that CPU time is the step's whole work, which a
loaded machine leaves nearly as it is while it stretches the wall time (with more threads, their
CPU time is not counted). The base model runs eager (``compile: off``), as ``enable_lora`` does.

    .venv/bin/python scripts/lora_step_time.py --rounds 8 --lora-kernel native torch
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def start(engine, loras: list, tokens: int) -> None:
    from modserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(16):  # 100-token prompts, distinct: nothing shared
        engine.add_request(f"r{i}", list(range(100 + i, 200 + i)), params, lora_request=loras[i % len(loras)])
    for _ in range(2):  # the prefill and a first decode
        engine.step()


def time_updates(engine) -> list[float]:
    """A one-element list the engine's LoRA kernel adds the CPU seconds of each update to."""
    spent = [0.0]
    if engine.runner.lora is None:
        return spent
    kernel = next(iter(engine.runner.lora.layers.values())).kernel  # one for every layer
    add = kernel.add

    def timed(*args) -> None:
        begin = time.thread_time()
        add(*args)
        spent[0] += time.thread_time() - begin

    kernel.add = timed
    return spent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch's (and the C++ kernels') threads")
    ap.add_argument("--lora-kernel", nargs="+", choices=["native", "torch"], default=["native", "torch"],
                    help="the cpu platform's lora_kernel option(s) to time, side by side")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from lora_oracle import ALL, make_adapter

    from modserve import LLM, LoRARequest
    from modserve.testing import cached_checkpoint

    base = str(cached_checkpoint("llama", preset="small"))
    root = Path(tempfile.mkdtemp(prefix="lora-cost-"))
    adapters = [LoRARequest(f"a{i}", i + 1, make_adapter(base, root / f"a{i}", 16, ALL, seed=i)) for i in range(4)]
    common = dict(progress=False, num_kv_blocks=256, compile="off", num_threads=args.threads)
    rows = [("base model", {}, [None])]
    for kernel in args.lora_kernel:
        lora = dict(enable_lora=True, max_loras=4, max_lora_rank=16,
                    platform={"name": "cpu", "options": {"lora_kernel": kernel}})
        rows += [(f"{kernel}: enable_lora, no adapter", lora, [None]),
                 (f"{kernel}: 1 adapter on every row", lora, adapters[:1]),
                 (f"{kernel}: 4 distinct adapters, 4 rows each", lora, adapters)]
    engines = [LLM(base, **common, **extra).engine for _, extra, _ in rows]
    for engine, (_, _, loras) in zip(engines, rows):
        start(engine, loras, 5 * args.rounds + 10)
    spent = [time_updates(engine) for engine in engines]
    cpu: list[list[float]] = [[] for _ in rows]
    wall: list[list[float]] = [[] for _ in rows]
    updates: list[list[float]] = [[] for _ in rows]
    for _ in range(args.rounds):
        for engine, cpu_ms, wall_ms, update_ms, total in zip(engines, cpu, wall, updates, spent):
            for _ in range(5):
                begin, begin_cpu, before = time.perf_counter(), time.thread_time(), total[0]
                engine.step()
                cpu_ms.append((time.thread_time() - begin_cpu) * 1e3)
                wall_ms.append((time.perf_counter() - begin) * 1e3)
                update_ms.append((total[0] - before) * 1e3)
    print("| 16-sequence decode step | CPU ms (fastest) | CPU ms (median) | of which LoRA updates (median) "
          "| wall ms (median) |\n|---|---|---|---|---|")
    for (what, _, _), cpu_ms, wall_ms, update_ms in zip(rows, cpu, wall, updates):
        print(f"| {what} | {min(cpu_ms):.1f} | {statistics.median(cpu_ms):.1f} | {statistics.median(update_ms):.1f} "
              f"| {statistics.median(wall_ms):.1f} |")
    for engine in engines:
        while engine.has_unfinished_requests():
            engine.step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
