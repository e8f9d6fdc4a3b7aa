"""Time one decoder's linears over a checkpoint's shapes through each CPU route, by row count.

    .venv/bin/python scripts/linear_routes.py --model CKPT [--rows 1 2 3 4 8 16 32 64 256] [--repeats 5]
        [--threads N] [--clock wall|cpu] [--stat median|min] [--huge-pages] [--routes WORD ...]

Per row count, every layer's qkv, o, gate_up and down projection (and the LM head) as one pass
over the model's bf16 weights, through: the AVX512-BF16 dot kernel (``bf16_dot_linear``, where
built), oneDNN's bf16 GEMM (``at::mm`` on bf16: AMX tiles where present), the few-rows kernel
over a bf16 copy (``few_rows_linear``, float32 input, up to 16 rows), the ``bf16_gemm`` route's
copies packed at load (oneDNN's layout; the AMX tiles' own, ``pack_tiles``, where the CPU has
AMX-BF16: ``bf16_gemm_linear`` from either; and from the tiles with oneDNN's brgemm at every row
count, ``AMX tiles by brgemm``, where the kernel takes 32 rows and more itself), and the float32 GEMM on
float32 weights in panels (``panel_linear``: what the ``few_rows`` route runs beyond 16 rows,
its weights packed at load; at each ``--few-rows-floats`` width, which sets its tile's too).
Weights are fresh random tensors of the checkpoint's shapes, so a model larger than the
last-level cache streams from memory as in decode; ``--huge-pages`` puts them in 2 MiB pages,
as the cpu platform does with a model's. Prints the median (``--stat``)
time of ``--repeats`` interleaved passes and the bf16 weight bytes per second, naming the CPU;
``--clock cpu`` times CPU time instead, which leaves out the time slices other processes take
on a shared machine: the calling thread's with one thread; with N, the process's divided by
N (a pass's time on N cores of its own; run with ``OMP_WAIT_POLICY=passive``, so that waiting
threads do not spin). Before and after the table it prints the memory bandwidth ``bench
latency`` divides by (its cpu single-stream ceiling: the best float32 sum beyond the last-level
cache, wall-clock), a 256 MiB copy's rate beside it, and, with ``--clock cpu``, the read timed by
that clock. This is how
``kDotMaxRows`` and the few-rows kernel's width in ``csrc/bf16_linear.cpp`` were chosen.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from modserve.bench.plan import copy_buffers, measure_cpu, read_buffer
from modserve.plugins.platforms.cpu.features import cpu_features
from modserve.plugins.platforms.cpu.huge_pages import huge_page_buffer
from modserve.plugins.platforms.cpu.linear import FEW_ROWS, load_few_rows_kernel
from modserve.plugins.platforms.cpu.prepack import to_panels


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
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 64, 256])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: CPU time (one thread: the calling thread's; N: the process's / N)")
    ap.add_argument("--stat", choices=["median", "min"], default="median")
    ap.add_argument("--huge-pages", action="store_true", help="weights in 2 MiB pages, as the cpu platform's")
    ap.add_argument("--few-rows-floats", type=int, nargs="+", choices=[8, 16], default=None,
                    help="time the few-rows kernel at each of these vector widths (default: the one this CPU takes)")
    ap.add_argument("--routes", nargs="+", default=None, metavar="WORD",
                    help="only the routes whose name holds one of these words (e.g. GEMM, kernel)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    clock = cpu_clock(torch.get_num_threads()) if a.clock == "cpu" else time.perf_counter
    if not load_few_rows_kernel():
        raise SystemExit("the CPU kernels cannot be built here")
    config = json.loads((Path(a.model) / "config.json").read_text())
    weights = [placed((torch.randn(n, k) * 0.02).bfloat16(), a.huge_pages) for n, k in shapes(config)]
    panels = [placed(to_panels(w.float()), a.huge_pages) for w in weights]  # the few_rows route's float32 GEMM
    unread = [torch.zeros(()).expand(w.shape) for w in weights]  # few_rows_linear's float32 weight: unread here
    nbytes = sum(w.numel() * 2 for w in weights)
    ops = torch.ops.modserve_cpu
    routes = {"oneDNN bf16 GEMM": lambda x, w, f, p: torch.mm(x.bfloat16(), w.t()).float()}
    # the bf16_gemm route's copies packed at load (prepack_weights): oneDNN's layout, and the AMX tiles' own
    onednn = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights}
    routes["oneDNN packed"] = lambda x, w, f, p: ops.bf16_gemm_linear(x, w, onednn[id(w)], None)
    if ops.tiles_ready():
        tiles = {id(w): placed(ops.pack_tiles(w), a.huge_pages) for w in weights}
        routes["AMX tiles"] = lambda x, w, f, p: ops.bf16_gemm_linear(x, w, tiles[id(w)], None)
        routes["AMX tiles by brgemm"] = functools.partial(tiles_by_brgemm, tiles)
    if ops.bf16_dot_built():
        routes["AVX512-BF16 dot"] = lambda x, w, f, p: ops.bf16_dot_linear(x, w)
    widths = a.few_rows_floats or [ops.few_rows_floats()]
    for floats in widths:
        name = f"few-rows kernel ({floats}-float)" if a.few_rows_floats else "few-rows kernel"
        routes[name] = functools.partial(few_rows, floats)
    for floats in widths:
        name = f"float32 GEMM ({floats}-float)" if a.few_rows_floats else "float32 GEMM"
        routes[name] = functools.partial(panel_gemm, floats)
    if a.routes:
        routes = {r: fn for r, fn in routes.items() if any(word in r for word in a.routes)}
    print(f"cpu: {cpu_features().describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"few-rows kernel in {ops.few_rows_floats()}-float vectors")
    print(f"{a.model}: {nbytes / 2**20:.0f} MiB of bf16 linear weights{' in 2 MiB pages' if a.huge_pages else ''}; "
          f"{a.stat} of {a.repeats} interleaved passes, {'CPU' if a.clock == 'cpu' else 'wall-clock'} time")
    print(ceiling(clock if a.clock == "cpu" else None))
    print("\n| rows | " + " | ".join(f"{r} ms (GB/s)" for r in routes) + " |")
    print("|---" * (len(routes) + 1) + "|")
    for rows in a.rows:
        inputs = {k: torch.randn(rows, k) for k in {k for _, k in shapes(config)}}
        wanted = {r: fn for r, fn in routes.items() if not r.startswith("few-rows kernel") or rows <= FEW_ROWS}
        times: dict[str, list[float]] = {r: [] for r in wanted}
        for repeat in range(a.repeats + 1):
            for route, fn in wanted.items():
                start = clock()
                for w, f, p in zip(weights, unread, panels):
                    fn(inputs[w.shape[1]], w, f, p)
                if repeat:  # the first pass warms up
                    times[route].append(clock() - start)
        cells = []
        for route in routes:
            if route not in times:
                cells.append("-")
                continue
            t = statistics.median(times[route]) if a.stat == "median" else min(times[route])
            cells.append(f"{t * 1e3:.1f} ({nbytes / t / 1e9:.1f})")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)
    print(ceiling(clock if a.clock == "cpu" else None))


def tiles_by_brgemm(tiles: dict[int, torch.Tensor], x: torch.Tensor, w: torch.Tensor, f: torch.Tensor,
                    p: torch.Tensor) -> torch.Tensor:
    """The tiles' route with oneDNN's brgemm for every row count (``tiles_amx`` off)."""
    torch.ops.modserve_cpu.set_tiles_amx(False)
    try:
        return torch.ops.modserve_cpu.bf16_gemm_linear(x, w, tiles[id(w)], None)
    finally:
        torch.ops.modserve_cpu.set_tiles_amx(True)


def few_rows(floats: int, x: torch.Tensor, w: torch.Tensor, f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    torch.ops.modserve_cpu.set_few_rows_floats(floats)
    return torch.ops.modserve_cpu.few_rows_linear(x, f, w, None, None)


def panel_gemm(floats: int, x: torch.Tensor, w: torch.Tensor, f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    torch.ops.modserve_cpu.set_few_rows_floats(floats)  # the panel GEMM's tile width, as the kernel's
    return torch.ops.modserve_cpu.panel_linear(x, p, w.shape[0], None)


def placed(t: torch.Tensor, huge_pages: bool) -> torch.Tensor:
    """``t``, or a copy of it in 2 MiB pages (as the cpu platform moves a model's weights)."""
    if not huge_pages:
        return t
    copy = huge_page_buffer(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
    return copy.copy_(t)


def cpu_clock(threads: int) -> Callable[[], float]:
    """Seconds of CPU time: the calling thread's, or the process's over ``threads`` threads."""
    return time.thread_time if threads == 1 else lambda: time.process_time() / threads


def ceiling(clock: Callable[[], float] | None) -> str:
    """The bandwidth ``bench latency``'s cpu ceiling divides by (:func:`measure_cpu`'s best read,
    wall-clock), a 256 MiB copy's beside it, and, given ``clock``, the read's best of 10 timed by it."""
    src, dst = copy_buffers(256 << 20)
    copy = 2 * src.nbytes / min(_timed(lambda: dst.copy_(src), time.perf_counter))
    del src, dst
    line = (f"memory: read {measure_cpu().bandwidth / 1e9:.1f} GB/s (bench latency's cpu ceiling: best float32 sum "
            f"beyond the last-level cache); copy {copy / 1e9:.1f} GB/s (best of 256 MiB)")
    if clock is None:
        return line
    buffer = read_buffer()
    return line + f"; the same read in CPU time: {buffer.nbytes / min(_timed(buffer.sum, clock)) / 1e9:.1f} GB/s"


def _timed(fn: Callable[[], object], clock: Callable[[], float], repeats: int = 10) -> list[float]:
    """``repeats`` times of ``fn`` after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return times


if __name__ == "__main__":
    main()
