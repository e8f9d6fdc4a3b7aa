"""The int8 op's speed by what many-row steps do with x (``Int8Options.activations``): the
table of docs/quantization.md's "int8 activations" section.

One decoder layer of the ``1b`` preset (fused qkv, o, fused gate/up, down: Llama-3.2-1B's
shapes), random weights quantized as ``int8`` does, multiplied by random rows of x through
``modserve_int8::linear`` (float32), ``linear_bf16`` (bf16, AMX tiles) and ``linear_dynamic``
(int8), round-robin. Per layer: the median of the repeats, as wall time and GOP/s. A kind
the CPU cannot run (bf16 without AMX-BF16) is left out, with the reason.

    .venv/bin/python scripts/int8_activations_speed.py [--rows 17 64 128 512 2048] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from modserve.plugins.platforms.cpu.features import cpu_features
from modserve.quantizers.int8 import load_cpu_kernel, quantize_rows

LAYER = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # [N, K] of qkv, o, gate/up, down
OPS = {"float32": "linear", "bf16": "linear_bf16", "int8": "linear_dynamic"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[17, 64, 128, 512, 2048])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    problem = load_cpu_kernel()
    if problem:
        raise SystemExit(f"the int8 op cannot run: {problem}")
    kinds = dict(OPS)
    if not torch.ops.modserve_int8.bf16_tiles():
        print("bf16 left out: this CPU has no AMX-BF16 tiles")
        del kinds["bf16"]
    g = torch.Generator().manual_seed(0)
    weights = [quantize_rows(torch.randn(n, k, generator=g) / 50) for n, k in LAYER]
    print(f"{cpu_features().describe()}, torch {torch.__version__}, {args.threads} threads; one layer of the 1b "
          f"preset, median of {args.repeats}")
    print("| rows | " + " | ".join(kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for rows in args.rows:
        xs = [torch.randn(rows, k, generator=g) for _, k in LAYER]
        ops = 2 * rows * sum(n * k for n, k in LAYER)
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for repeat in range(args.repeats + 1):  # the first round builds oneDNN's kernels
            for kind, op in kinds.items():
                fn = getattr(torch.ops.modserve_int8, op)
                start = time.perf_counter()
                for x, (q, s) in zip(xs, weights):
                    fn(x, q, s, None)
                if repeat:
                    times[kind].append(time.perf_counter() - start)
        cells = [f"{statistics.median(t) * 1e3:,.1f} ms ({ops / statistics.median(t) / 1e9:,.0f} GOP/s)"
                 for t in times.values()]
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
