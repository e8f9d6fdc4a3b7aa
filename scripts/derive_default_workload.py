"""Derive modserve's default benchmark workload from the shared ShareGPT material.

Run once by a developer; the result is committed under modserve/bench/data/ so that
nothing reads the shared folder at run time:

    python scripts/derive_default_workload.py ../shared/corpora/workload \
        modserve/bench/data/sharegpt-128.jsonl

Prompts: 128 of the 500 real first-turn ShareGPT prompts (ml-energy/leaderboard-v2,
Apache-2.0), drawn with a fixed seed among those of at most 2,000 characters.
Output lengths: the per-turn ShareGPT decode lengths of microsoft/sarathi-serve's
table (Apache-2.0), drawn with the same seed, divided by 8 for CPU-sized runs (the
workload README's suggestion: keep the shape, scale the size) and clipped to [4, 128].
"""

from __future__ import annotations

import csv
import json
import random
import sys
from pathlib import Path

NUM_PROMPTS = 128
MAX_PROMPT_CHARS = 2000
OUTPUT_SCALE = 8
OUTPUT_RANGE = (4, 128)
SEED = 0


def main(src: Path, dst: Path) -> None:
    rng = random.Random(SEED)
    convs = json.loads((src / "ShareGPT_V3_filtered_500.json").read_text())
    prompts = [(c["id"], c["conversations"][0]["value"]) for c in convs
               if c["conversations"] and len(c["conversations"][0]["value"]) <= MAX_PROMPT_CHARS]
    chosen = rng.sample(prompts, NUM_PROMPTS)
    with open(src / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv") as f:
        decode = [int(row["num_decode_tokens"]) for row in csv.DictReader(f)]
    lo, hi = OUTPUT_RANGE
    with open(dst, "w") as out:
        for source_id, prompt in chosen:
            n = min(hi, max(lo, round(rng.choice(decode) / OUTPUT_SCALE)))
            out.write(json.dumps({"prompt": prompt, "output_tokens": n, "source_id": source_id},
                                 ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
