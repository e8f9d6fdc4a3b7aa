"""Decode step time against the number of sequences, the CPU platform's native decode step
on and off, as a figure.

Runs ``scripts/decode_step_time.py`` with ``--native-decode on`` and ``off`` in alternating
processes, ``--rounds`` times each, and plots the median ms per step of each batch size:

    .venv/bin/python scripts/native_decode_figure.py --model build/ref-small \\
        --batch-sizes 1 4 8 16 24 32 64 --out docs/figures/native-decode-step.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).with_name("decode_step_time.py")


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{os.cpu_count()}-core {names[0] if names else platform.machine()}"


def model_label(model: str) -> str:
    """"ref-small (88M Llama)": the folder and the parameter count its config implies."""
    c = json.loads((Path(model) / "config.json").read_text())
    h, layers, vocab, inter = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    heads, kv_heads = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    d = c.get("head_dim") or h // heads
    per_layer = h * d * (2 * heads + 2 * kv_heads) + 3 * h * inter + 2 * h
    params = vocab * h * (1 if c.get("tie_word_embeddings") else 2) + layers * per_layer + h
    arch = c.get("model_type", "").capitalize()
    return f"{Path(model).name} ({params / 1e6:.0f}M {arch})"


def run(model: str, sizes: list[int], native: str, quantization: str | None) -> dict[int, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        cmd = [sys.executable, str(SCRIPT), "--model", model, "--native-decode", native, "--json", str(out),
               "--batch-sizes", *map(str, sizes)] + (["--quantization", quantization] if quantization else [])
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return {int(n): ms for n, ms in json.loads(out.read_text()).items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 24, 32, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization")
    ap.add_argument("--out", required=True, help="the PNG to write")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, list[dict[int, float]]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for native in ("off", "on"):
            runs[native].append(run(args.model, args.batch_sizes, native, args.quantization))
            print(f"round {r + 1}/{args.rounds}, native decode {native}: {runs[native][-1]}", flush=True)
    median = {k: [statistics.median(run[n] for run in v) for n in args.batch_sizes] for k, v in runs.items()}
    print("| sequences | compiled ms | native ms | compiled / native |\n|---|---|---|---|")
    for n, off, on in zip(args.batch_sizes, median["off"], median["on"]):
        print(f"| {n} | {off:.1f} | {on:.1f} | {off / on:.2f}x |")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label in (("off", "compiled forward (torch.compile regions)"), ("on", "native decode step (one C++ call)")):
        ax.plot(args.batch_sizes, median[key], marker="o", label=label)
    ax.set_xlabel("sequences decoding in the step")
    ax.set_ylabel("ms per decode step (median)")
    weights = args.quantization or "bf16 decode weights"
    ax.set_title(f"Decode step time: {model_label(args.model)}, {weights}, {cpu_name()}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
