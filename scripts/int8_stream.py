"""How fast the int8 quantizer's C++ op streams its weights: GB/s of int8 weights read against
the CPU's single-stream ceiling, at 1-16 rows, over a model's linear shapes.

The weights are random floats of the checkpoint's linear shapes (fused qkv and gate/up, as
the model loads them, and the LM head) quantized as ``int8`` does, in huge pages where the OS
gives them (as the cpu platform's weights are). One pass calls ``modserve_int8::linear`` on
every linear in turn, as a decode step does; its bytes are the int8 weights once (16 rows
read them twice, in two passes of 8). The ceiling is what ``bench latency`` divides by: the
read bandwidth of ``modserve.bench.plan.measure_cpu``, measured here at each thread count.

Per pass: wall time, and CPU time (one thread: the calling thread's, which leaves out time
slices other processes take on a shared machine; more threads: the process's, per thread).
Median of interleaved repeats. ``--against FILE`` times another version of the kernel's
source (e.g. ``git show HEAD:modserve/quantizers/csrc/int8_linear.cpp > /tmp/old.cpp``) in
the same rounds; ``--path`` adds the op's compiled paths by name (``modserve_int8::paths``).

    .venv/bin/python scripts/int8_stream.py --rows 1 2 4 8 16 --threads 1 2 [--against /tmp/old.cpp]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def linear_shapes(config: dict) -> list[tuple[int, int]]:
    """(out, in) of every linear a decode step runs, in order."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    i = config["intermediate_size"]
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)] * layers + [(config["vocab_size"], h)]


def int8_weights(shapes: list[tuple[int, int]], seed: int = 0) -> list[tuple["torch.Tensor", "torch.Tensor"]]:
    import torch

    from modserve.quantizers.int8 import quantize_rows

    try:
        from modserve.plugins.platforms.cpu.huge_pages import huge_page_buffer
    except ImportError:
        huge_page_buffer = None
    g = torch.Generator().manual_seed(seed)
    weights = []
    for n, k in shapes:
        q, s = quantize_rows(torch.randn(n, k, generator=g) * 0.02)
        if huge_page_buffer is not None:
            try:
                q = huge_page_buffer(q.numel()).view(torch.int8).view(n, k).copy_(q)
            except (OSError, AttributeError):
                pass
        weights.append((q, s))
    return weights


def linear_path(x, q, s, b, path: str):
    import torch

    return torch.ops.modserve_int8.linear_path(x, q, s, b, path)


def kernel_against(source: str) -> str:
    """Load another version of int8_linear.cpp under the op namespace modserve_int8_against."""
    from modserve.api.cpp import load_kernel

    text = Path(source).read_text().replace("TORCH_LIBRARY(modserve_int8,", "TORCH_LIBRARY(modserve_int8_against,")
    folder = Path(tempfile.gettempdir()) / f"int8_against_{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    folder.mkdir(exist_ok=True)  # one path per source: the build's ninja file names it, and a new path rebuilds
    path = folder / "int8_linear_against.cpp"
    path.write_text(text)
    problem = load_kernel("modserve_int8_linear_against", str(path))
    if problem:
        raise SystemExit(f"--against {source}: {problem}")
    return "against"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint directory (default: the cached 1b preset)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--against", help="another int8_linear.cpp, timed in the same rounds")
    ap.add_argument("--path", nargs="+", help="also time these of the op's paths (modserve_int8::paths)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    import torch

    from modserve.bench.plan import measure_cpu, read_buffer
    from modserve.quantizers.int8 import load_cpu_kernel

    if problem := load_cpu_kernel():
        raise SystemExit(f"the int8 op cannot be built: {problem}")
    if args.model is None:
        from modserve.testing.checkpoints import cached_checkpoint

        args.model = str(cached_checkpoint("llama", "1b", dtype="bfloat16"))
    config = json.loads((Path(args.model) / "config.json").read_text())
    shapes = linear_shapes(config)
    weights = int8_weights(shapes)
    nbytes = sum(q.numel() for q, _ in weights)
    ops = {"this": torch.ops.modserve_int8.linear}
    for path in args.path or []:
        ops[f"this, {path}"] = functools.partial(linear_path, path=path)
    if args.against:
        name = kernel_against(args.against)
        ops[name] = torch.ops.modserve_int8_against.linear
    xs = {(m, k): torch.randn(m, k) for m in args.rows for k in {k for _, k in shapes}}  # [m, K]

    def cpu_time(fn, threads: int) -> float:  # the calling thread's, or the process's per thread
        clock = time.thread_time if threads == 1 else time.process_time
        start = clock()
        fn()
        return (clock() - start) / threads

    def one_pass(op, m: int) -> tuple[float, float, float]:
        wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
        for q, s in weights:
            op(xs[m, q.shape[1]], q, s, None)
        return time.perf_counter() - wall, time.thread_time() - thread, time.process_time() - process

    print(f"{len(shapes)} linears of {args.model}: {nbytes / 2**20:.0f} MiB of int8 weights; "
          f"CPU {cpu_name()}; load average before: {os.getloadavg()[0]:.2f}")
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        ceiling = measure_cpu(seconds=0.5).bandwidth
        buffer = read_buffer()  # measure_cpu's read, timed by CPU time
        reads = [cpu_time(buffer.sum, threads) for _ in range(args.repeats)]
        ceiling_cpu = buffer.nbytes / statistics.median(reads)
        del buffer
        for m in args.rows:
            for op in ops.values():
                one_pass(op, m)  # warm-up
        times = {(name, m): [] for name in ops for m in args.rows}
        for _ in range(args.repeats):
            for m in args.rows:
                for name, op in ops.items():
                    times[name, m].append(one_pass(op, m))
        print(f"\n{threads} thread(s): ceiling {ceiling / 1e9:.1f} GB/s (measure_cpu's read bandwidth, wall), "
              f"{ceiling_cpu / 1e9:.1f} GB/s (the same read by CPU time); load average {os.getloadavg()[0]:.2f}; "
              f"median of {args.repeats} interleaved repeats")
        print("| kernel | rows | ms wall | GB/s wall | % of wall ceiling | ms CPU per thread | GB/s by CPU time "
              "| % of CPU-time ceiling |")
        print("|---|---|---|---|---|---|---|---|")
        for (name, m), runs in times.items():
            wall = statistics.median(r[0] for r in runs)
            cpu = statistics.median((r[1] if threads == 1 else r[2] / threads) for r in runs)
            print(f"| {name} | {m} | {wall * 1e3:.1f} | {nbytes / wall / 1e9:.1f} | {nbytes / wall / ceiling:.0%} "
                  f"| {cpu * 1e3:.1f} | {nbytes / cpu / 1e9:.1f} | {nbytes / cpu / ceiling_cpu:.0%} |")
            results.append(dict(kernel=name, threads=threads, rows=m, wall_s=wall, cpu_s=cpu, weight_bytes=nbytes,
                                ceiling_gb_s=ceiling / 1e9, ceiling_cpu_gb_s=ceiling_cpu / 1e9))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
