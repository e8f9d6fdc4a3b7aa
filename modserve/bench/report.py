"""Tables (markdown, which also reads well in a terminal) and the comparison figure."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from modserve.bench.metrics import Spread, ratio_spread


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in rows)])


def spread_table(figures: dict[str, list[dict[str, float]]], digits: int = 1) -> str:
    """One row per figure, one column per runner: median [min-max] over the repeats; with two
    runners a last column gives their ratio, computed per interleaved pair."""
    names = list(figures)
    keys = list(figures[names[0]][0])
    headers = ["", *names] + ([f"{names[0]} / {names[1]}"] if len(names) == 2 else [])
    rows = []
    for key in keys:
        cols = {n: [run[key] for run in figures[n]] for n in names}
        row = [key, *(Spread.of(cols[n]).format(digits) for n in names)]
        if len(names) == 2:
            row.append(ratio_spread(cols[names[0]], cols[names[1]]).format(2) + "x")
        rows.append(row)
    return table(headers, rows)


def hardware_line() -> str:
    """What ran it, for a figure's title: the GPU's name, else the CPU's model and core count."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    model = "CPU"
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {len(os.sched_getaffinity(0))} cores"


def plot_compare(path: str | Path, latencies: dict[str, dict[str, list[float]]],
                 throughputs: dict[str, list[float]], title: str = "") -> None:
    """Latency CDFs (one panel per latency kind, one line per config) and output-throughput
    bars (median, with min-max whiskers over the repeats). Latencies in seconds. ``title``:
    what was compared; the machine is added to it.

    NOTE: the latency axes are logarithmic: one 2 s outlier would otherwise squash the
    0-200 ms range where nearly every sample lies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(next(iter(latencies.values())))
    fig, axes = plt.subplots(1, len(kinds) + 1, figsize=(4.5 * (len(kinds) + 1), 3.8))
    for ax, kind in zip(axes, kinds):
        for name, per_kind in latencies.items():
            xs = np.sort(np.asarray(per_kind[kind]) * 1e3)
            ax.step(xs, np.arange(1, len(xs) + 1) / max(len(xs), 1), where="post", label=name)
        unit = "token gaps" if kind.upper() == "ITL" else "requests"  # ITL: every gap of every request
        ax.set(title=f"{kind} CDF", xlabel="ms (log scale)", ylabel=f"fraction of {unit}", ylim=(0, 1.02))
        ax.set_xscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="lower right", fontsize="small", framealpha=0.8)  # a CDF's lower right is empty
    ax = axes[-1]
    names = list(throughputs)
    spreads = [Spread.of(throughputs[n]) for n in names]
    medians = [s.median for s in spreads]
    errors = [[s.median - s.lo for s in spreads], [s.hi - s.median for s in spreads]]
    ax.bar(names, medians, yerr=errors, capsize=6, color=["tab:blue", "tab:orange"][: len(names)])
    ax.set(title="output throughput (median, min-max)", ylabel="tokens/s")
    fig.suptitle(f"{title} · {hardware_line()}" if title else hardware_line(), fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
