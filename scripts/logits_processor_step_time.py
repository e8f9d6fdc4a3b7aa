"""Time a greedy decode step with no logits processor configured, with ``no_repeat_ngram`` configured
but asked for by no request, and with every request asking for it (``no_repeat_ngram_size`` 3).

The three engines take turns, round after round, so a load on the machine falls on all of them;
the median step of each is printed (docs/writing-a-plugin.md quotes it).

    .venv/bin/python scripts/logits_processor_step_time.py --batch-size 8 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the tiny test Llama)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    from modserve import LLM, SamplingParams
    from modserve.testing import cached_checkpoint

    model = args.model or str(cached_checkpoint("llama"))
    setups = {  # name -> (engine, extra_args of every request)
        "none configured": (LLM(model, progress=False, max_model_len=512).engine, None),
        "configured, unused": (LLM(model, progress=False, max_model_len=512,
                                   logits_processors=["no_repeat_ngram"]).engine, None),
        "every request n=3": (LLM(model, progress=False, max_model_len=512,
                                  logits_processors=["no_repeat_ngram"]).engine, {"no_repeat_ngram_size": 3}),
    }
    times: dict[str, list[float]] = {name: [] for name in setups}
    for r in range(args.rounds):
        for name, (engine, extra) in setups.items():
            params = SamplingParams(temperature=0.0, max_tokens=args.steps + 4, ignore_eos=True, extra_args=extra)
            for i in range(args.batch_size):  # 150-token prompts, distinct
                engine.add_request(f"{r}-{i}", list(range(100 + i, 250 + i)), params)
            engine.step()  # the prefill
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
            while engine.has_unfinished_requests():
                engine.step()
    print(f"| {args.batch_size} sequences, greedy | median ms per decode step | all rounds |\n|---|---|---|")
    for name, ms in times.items():
        print(f"| {name} | {statistics.median(ms):.2f} | {' '.join(f'{t:.2f}' for t in ms)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
