"""Time one decoder's linears over a checkpoint's shapes through each CPU route, by row count.

    .venv/bin/python scripts/linear_routes.py --model CKPT [--rows 1 2 4 8 16 64] [--repeats 5]

Per row count, every layer's qkv, o, gate_up and down projection (and the LM head) as one pass
over the model's bf16 weights, through: the AVX512-BF16 dot kernel (``bf16_dot_linear``, where
built), oneDNN's bf16 GEMM (``at::mm`` on bf16: AMX tiles where present), and the few-rows
kernel over a bf16 copy (``few_rows_linear``, float32 input; beyond 16 rows it falls back to
float32 GEMMs, not timed). Weights are fresh random tensors of the checkpoint's shapes, so a
model larger than the last-level cache streams from memory as in decode. Prints the median
time of ``--repeats`` interleaved passes and the weight bytes per second, naming the CPU; this
is how ``kDotMaxRows`` in ``csrc/bf16_linear.cpp`` was chosen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from modserve.plugins.platforms.cpu.features import cpu_features
from modserve.plugins.platforms.cpu.linear import FEW_ROWS, load_few_rows_kernel


def shapes(config: dict) -> list[tuple[int, int]]:
    """[out, in] of one layer's four projections, repeated per layer, and the LM head."""
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    layer = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    return layer * config["num_hidden_layers"] + [(config["vocab_size"], h)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if not load_few_rows_kernel():
        raise SystemExit("the CPU kernels cannot be built here")
    config = json.loads((Path(a.model) / "config.json").read_text())
    weights = [(torch.randn(n, k) * 0.02).bfloat16() for n, k in shapes(config)]
    floats = [w.float() for w in weights]  # few_rows_linear's float32 weight (unread up to 16 rows)
    nbytes = sum(w.numel() * 2 for w in weights)
    ops = torch.ops.modserve_cpu
    routes = {"oneDNN bf16 GEMM": lambda x, w, f: torch.mm(x.bfloat16(), w.t()).float()}
    if ops.bf16_dot_built():
        routes["AVX512-BF16 dot"] = lambda x, w, f: ops.bf16_dot_linear(x, w)
    routes["few-rows kernel"] = lambda x, w, f: ops.few_rows_linear(x, f, w, None, None)
    print(f"cpu: {cpu_features().describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{a.model}: {nbytes / 2**20:.0f} MiB of bf16 linear weights; median of {a.repeats} interleaved passes")
    print("\n| rows | " + " | ".join(f"{r} ms (GB/s)" for r in routes) + " |")
    print("|---" * (len(routes) + 1) + "|")
    for rows in a.rows:
        inputs = {k: torch.randn(rows, k) for k in {k for _, k in shapes(config)}}
        wanted = {r: fn for r, fn in routes.items() if r != "few-rows kernel" or rows <= FEW_ROWS}
        times: dict[str, list[float]] = {r: [] for r in wanted}
        for repeat in range(a.repeats + 1):
            for route, fn in wanted.items():
                start = time.perf_counter()
                for w, f in zip(weights, floats):
                    fn(inputs[w.shape[1]], w, f)
                if repeat:  # the first pass warms up
                    times[route].append(time.perf_counter() - start)
        cells = []
        for route in routes:
            if route not in times:
                cells.append("-")
                continue
            t = statistics.median(times[route])
            cells.append(f"{t * 1e3:.1f} ({nbytes / t / 1e9:.1f})")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
