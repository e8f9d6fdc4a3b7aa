"""What a prefill's new row count costs oneDNN's bf16 GEMM: ``modserve_cpu::bf16_gemm`` (rows
padded to a multiple of 16 beyond 256) against ``torch.mm`` on the same rows unpadded.

oneDNN makes a kernel for every new row count and weight shape on its first call. A server's
prefill steps come in every length; the script draws ``--steps`` row counts at random in
``[257, --max-rows]``, as such steps would, and times both over the model's linear shapes (fused
qkv, o, fused gate/up, down, the LM head), alternating per row count, first with every count
new to both, then once more with every kernel made.

    .venv/bin/python scripts/prefill_row_counts.py --model $SMALL --steps 150
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a checkpoint folder: its config.json gives the shapes")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--max-rows", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from modserve.plugins.platforms.cpu.linear import load_few_rows_kernel

    if not load_few_rows_kernel():
        raise SystemExit("the CPU kernels cannot be built here")
    c = json.loads((Path(args.model) / "config.json").read_text())
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim
    shapes = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter),
              (c["vocab_size"], hidden)]  # [N, K] each
    weights = [torch.randn(n, k).bfloat16() for n, k in shapes]
    rng = random.Random(args.seed)
    rows = [rng.randrange(257, args.max_rows + 1) for _ in range(args.steps)]
    ops = {"torch.mm, unpadded": lambda x, w: torch.mm(x, w.t()),
           "modserve_cpu::bf16_gemm": lambda x, w: torch.ops.modserve_cpu.bf16_gemm(x, w, None)}
    print(f"{args.steps} row counts drawn from [257, {args.max_rows}], {len(shapes)} weight shapes {shapes}")
    for label in ("every row count new", "every kernel made"):
        total = dict.fromkeys(ops, 0.0)
        for i, m in enumerate(rows):
            xs = [torch.zeros(m, k, dtype=torch.bfloat16) for _, k in shapes]
            for name in (list(ops) if i % 2 else list(ops)[::-1]):
                start = time.perf_counter()
                for x, w in zip(xs, weights):
                    ops[name](x, w)
                total[name] += time.perf_counter() - start
        print(f"{label}: " + ", ".join(f"{name} {t:.2f} s" for name, t in total.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
