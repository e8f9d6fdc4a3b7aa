"""Time a decode step of 16 sequences under 0, 1 and 4 distinct LoRA adapters against the base model.

Random rank-16 adapters on every projection of a ~88M Llama (``small`` preset, float32). The
engines are alive together and stepped in turns, 5 steps each per round, so load from other
processes falls on all of them alike; each row is the fastest step seen (and the median).
The base model runs eager (``compile: off``), as ``enable_lora`` does.

    .venv/bin/python scripts/lora_step_time.py --rounds 8
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from lora_oracle import ALL, make_adapter

    from modserve import LLM, LoRARequest
    from modserve.testing import cached_checkpoint

    base = str(cached_checkpoint("llama", preset="small"))
    root = Path(tempfile.mkdtemp(prefix="lora-cost-"))
    adapters = [LoRARequest(f"a{i}", i + 1, make_adapter(base, root / f"a{i}", 16, ALL, seed=i)) for i in range(4)]
    common = dict(progress=False, num_kv_blocks=256, compile="off")
    lora = dict(enable_lora=True, max_loras=4, max_lora_rank=16)
    rows = [("base model", {}, [None]), ("enable_lora, no adapter", lora, [None]),
            ("1 adapter on every row", lora, adapters[:1]), ("4 distinct adapters, 4 rows each", lora, adapters)]
    engines = [LLM(base, **common, **extra).engine for _, extra, _ in rows]
    for engine, (_, _, loras) in zip(engines, rows):
        start(engine, loras, 5 * args.rounds + 10)
    times: list[list[float]] = [[] for _ in rows]
    for _ in range(args.rounds):
        for engine, seen in zip(engines, times):
            for _ in range(5):
                begin = time.perf_counter()
                engine.step()
                seen.append((time.perf_counter() - begin) * 1e3)
    print("| 16-sequence decode step | ms (fastest) | ms (median) |\n|---|---|---|")
    for (what, _, _), seen in zip(rows, times):
        print(f"| {what} | {min(seen):.1f} | {statistics.median(seen):.1f} |")
    for engine in engines:
        while engine.has_unfinished_requests():
            engine.step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
