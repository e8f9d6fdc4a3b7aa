"""The thread CPU time of an engine core's decode step, as an engine-core process runs it.

The engine is built as ``modserve.engine.core_process`` builds it (``detokenize=False``), N
requests (32-token prompts, a stop string each, greedy) are prefilled, then ``--steps``
decode steps per round are timed with ``time.thread_time``: ``engine.step()`` and the
msgpack encoding of its Outputs message, whole and less the forward (every rank's
``RunModel``). The median over ``--rounds``. Run with ``OMP_NUM_THREADS=1``.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/core_step_time.py --batch-sizes 1 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def measure(engine, n: int, steps: int, rounds: int) -> tuple[float, float]:
    """Microseconds per decode step of ``n`` sequences: (whole, less the forward)."""
    from modserve import SamplingParams
    from modserve.engine import core_protocol as p

    forward = [0.0]
    run = engine.runner.on_every_rank

    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return run(*args, **kwargs)
        finally:
            forward[0] += time.thread_time() - start

    engine.runner.on_every_rank = timed

    def step() -> None:
        if outputs := engine.step():
            p.encode(p.Outputs(outputs))

    params = SamplingParams(temperature=0.0, max_tokens=rounds * steps + 16, ignore_eos=True, stop=["\u00a7never\u00a7"])
    for i in range(n):
        engine.add_request(f"{n}-{i}", list(range(100 + i, 132 + i)), params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        step()
    whole, python = [], []
    for _ in range(rounds):
        forward[0] = 0.0
        start = time.thread_time()
        for _ in range(steps):
            step()
        spent = time.thread_time() - start
        whole.append(spent / steps * 1e6)
        python.append((spent - forward[0]) / steps * 1e6)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    engine.runner.on_every_rank = run
    return statistics.median(whole), statistics.median(python)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", help="a modserve.testing preset (llama)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=30, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from modserve.core.config import EngineConfig
    from modserve.engine.core_process import _build
    from modserve.testing import cached_checkpoint

    config = EngineConfig(model=str(cached_checkpoint("llama", args.preset)), num_threads=1,
                          max_num_seqs=max(args.batch_sizes))
    engine = _build(config.model_dump_json(), 0)
    print("| sequences | Python outside the forward (us) | whole step (us) |\n|---|---|---|")
    try:
        for n in args.batch_sizes:
            whole, python = measure(engine, n, args.steps, args.rounds)
            print(f"| {n} | {python:.0f} | {whole:.0f} |", flush=True)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
