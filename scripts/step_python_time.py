"""The CPU time of a decode step's Python outside the forward, by phase.

N requests are prefilled, then ``--steps`` decode steps are timed with the calling thread's
CPU time (``time.thread_time``, which leaves out what other processes take of a loaded
machine): the whole ``engine.step()`` and each phase inside it: scheduling, the batch's
input tensors (``ModelRunner._prepare``), the sampling settings (``sampling_batch``), the
forward with the logits (every rank's ``RunModel``), the sampler, the rest of ``execute``,
the scheduler's update, the output processor (``_emit``) and the rest of the step. "Python
outside the forward" is the whole step less the forward. Run with ``OMP_NUM_THREADS=1`` so
that the forward's work is on the timed thread too.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/step_python_time.py --preset tiny small --batch-sizes 1 16 64

With ``--replay MIB`` each decode step replays the logits of the first one of its size after
reading MIB MiB: the same Python with the caches as warm (0) or as cold (beyond the last-level
cache) as that leaves them, where a real forward leaves them as cold as the weights it reads.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from typing import Callable

PHASES = ("schedule", "batch build", "sampling prep", "forward + logits", "attention prepare", "sample",
          "runner rest", "update", "emit", "engine rest")


class PhaseClock:
    """Thread CPU time spent inside wrapped callables, by phase (nested phases counted in both)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def wrap(self, obj: object, name: str, phase: str) -> None:
        inner = getattr(obj, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[phase] += time.thread_time() - start

        setattr(obj, name, timed)


def instrument(engine) -> PhaseClock:
    clock = PhaseClock()
    runner = engine.runner
    clock.wrap(engine.scheduler, "step", "schedule")
    clock.wrap(runner, "_prepare", "batch build")
    clock.wrap(runner, "sampling_batch", "sampling prep")
    clock.wrap(runner, "on_every_rank", "forward + logits")
    clock.wrap(runner.attn, "prepare", "attention prepare")  # inside the forward: its per-step Python
    clock.wrap(runner, "_sample", "_sample")  # the sampler is what _sample spends beyond sampling_batch
    clock.wrap(runner, "execute", "execute")
    clock.wrap(engine.scheduler, "update", "update")
    clock.wrap(engine, "_emit", "emit")
    return clock


def split(spent: dict[str, float]) -> dict[str, float]:
    """The nested clocks as the disjoint PHASES plus "step" and "python" (step less forward)."""
    out = {p: spent.get(p, 0.0) for p in ("schedule", "batch build", "sampling prep", "forward + logits",
                                          "attention prepare", "update", "emit")}
    out["sample"] = spent["_sample"] - spent["sampling prep"]
    out["runner rest"] = spent["execute"] - spent["batch build"] - spent["forward + logits"] - spent["_sample"]
    out["engine rest"] = spent["step"] - spent["schedule"] - spent["execute"] - spent["update"] - spent["emit"]
    out["step"] = spent["step"]
    out["python"] = spent["step"] - spent["forward + logits"]
    return out


def from_scratch(runner) -> Callable:
    """``InputBatch.prepare`` as the runner did it before the persistent batch: ``build_batch``
    of every step from the sequences' lists."""
    from modserve.runner.batch import build_batch

    def prepare(seqs, chunks, context_lens, query_lens):
        return build_batch(chunks, context_lens, [s.block_ids for s in seqs], runner.block_size, runner.device)

    return prepare


def replay_forward(runner, mib: int) -> None:
    """The forward replaced by its first call's result, after a read of ``mib`` MiB (0: none):
    the step's Python with the caches as warm as a forward that touches that much leaves them.
    The tokens repeat; only the Python's time is of interest."""
    import numpy as np

    from modserve.runner.messages import RunModel

    forward, first = runner.on_every_rank, {}  # decode rows -> that step's logits
    swept = np.ones(mib << 17)  # float64: mib MiB

    def replayed(message):
        if not isinstance(message, RunModel) or message.meta.max_query_len > 1:  # prefills run
            return forward(message)
        if message.meta.num_tokens not in first:
            first[message.meta.num_tokens] = forward(message)
        swept.sum()
        return first[message.meta.num_tokens]

    runner.on_every_rank = replayed


def measure(engine, clock: PhaseClock, n: int, steps: int, rounds: int,
            variants: list[str]) -> dict[str, dict[str, float]]:
    """Per variant, microseconds per decode step of ``n`` sequences, by phase (``clock``, the
    engine's instrument): the median over ``rounds`` rounds (the variants' rounds interleaved)
    of each phase's mean over ``steps`` steps."""
    from modserve import SamplingParams

    batch = engine.runner.input_batch
    prepares = {"input batch": batch.prepare, "build_batch": from_scratch(engine.runner)}
    params = SamplingParams(temperature=0.0, max_tokens=len(variants) * rounds * steps + 8, ignore_eos=True)
    for i in range(n):  # 32-token prompts, distinct so nothing is shared
        engine.add_request(f"{n}-{i}", list(range(100 + i, 132 + i)), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    per_round: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(rounds):
        for variant in variants:
            batch.prepare = prepares[variant]
            clock.spent.clear()
            start = time.thread_time()
            for _ in range(steps):
                engine.step()
            clock.spent["step"] = time.thread_time() - start
            per_round[variant].append({k: v / steps * 1e6 for k, v in split(clock.spent).items()})
    batch.prepare = prepares["input batch"]
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in per_round.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", nargs="+", default=["tiny", "small"], help="modserve.testing presets (llama)")
    ap.add_argument("--model", help="a checkpoint directory instead of the presets")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=20, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", action="store_true",
                    help="also the step's tensors built from scratch (build_batch), rounds interleaved")
    ap.add_argument("--replay", type=int, metavar="MIB",
                    help="replace the forward by its first step's logits after a read of MIB MiB (0: none): "
                         "the Python with the caches as warm as that leaves them")
    ap.add_argument("--json", help="write {model: {sequences: {variant: {phase: us}}}} here")
    args = ap.parse_args()
    from modserve import LLM
    from modserve.testing import cached_checkpoint

    models = [args.model] if args.model else [str(cached_checkpoint("llama", p)) for p in args.preset]
    variants = ["input batch", "build_batch"] if args.before else ["input batch"]
    results: dict[str, dict[int, dict[str, dict[str, float]]]] = {}
    for model in models:
        engine = LLM(model, progress=False, max_num_seqs=max(args.batch_sizes)).engine
        name = model.rstrip("/").rsplit("/", 1)[-1]
        if args.replay is not None:
            replay_forward(engine.runner, args.replay)
        clock = instrument(engine)  # once, around the replay: every batch size through the same wrappers
        forward = "" if args.replay is None else f"; the forward replayed after a read of {args.replay} MiB"
        print(f"\n{name}: us of thread CPU time per decode step (median of {args.rounds} rounds x {args.steps}"
              f"{forward})")
        print("| sequences | step tensors | Python outside forward | " + " | ".join(PHASES) + " | whole step |")
        print("|---" * (len(PHASES) + 4) + "|")
        for n in args.batch_sizes:
            results.setdefault(name, {})[n] = got = measure(engine, clock, n, args.steps, args.rounds, variants)
            for variant, r in got.items():
                print(f"| {n} | {variant} | **{r['python']:.0f}** | " + " | ".join(f"{r[p]:.0f}" for p in PHASES)
                      + f" | {r['step']:.0f} |", flush=True)
        engine.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
