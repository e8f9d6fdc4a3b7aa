"""All-reduce and all-gather latency and bandwidth on real process groups (``modserve bench collectives``).

Tensor parallelism pays one all-reduce after each row-parallel linear (o_proj, down_proj: two
per decoder layer), one in the vocab-parallel embedding and one all-gather of the logits per
step. What those cost on this machine's interconnect decides whether TP wins; this measures
it. The figures are NCCL-tests' (nccl-tests/doc/PERFORMANCE.md):

- time: one collective, the slowest rank's (a collective is done when its last rank is);
  each one starts after a barrier, and median and p90 are over the timed iterations. An
  iteration runs every size once, so a burst of other work on a shared machine spreads over
  all sizes instead of spoiling one
- algbw = bytes / time
- busbw = algbw x 2(n-1)/n for all-reduce, algbw x (n-1)/n for all-gather: the bytes each
  rank's link carries per second, comparable with the link's bandwidth whatever n is.
  An all-gather's bytes are its gathered output (n parts), as NCCL-tests count them.

NOTE: on CUDA a time includes the launch and the synchronize (no CUDA graphs): what an eager
decode step pays per collective.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

KiB, MiB = 2**10, 2**20
OPS = ("all_reduce", "all_gather")
_UNITS = {"": 1, "B": 1, "K": KiB, "KB": KiB, "KIB": KiB, "M": MiB, "MB": MiB, "MIB": MiB,
          "G": 2**30, "GB": 2**30, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    """``"4096"``, ``"4K"``, ``"64MiB"`` -> bytes (binary units)."""
    s = str(text).strip().upper()
    digits = s.rstrip("BKMGI")
    try:
        value = float(digits) * _UNITS[s[len(digits):]]
    except (KeyError, ValueError):
        raise ValueError(f"{text!r} is not a size: expected bytes, or a number with K, M or G (binary)") from None
    return int(value)


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw (NCCL-tests)."""
    n = world_size
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """``min_bytes``, x ``factor``, ... up to ``max_bytes`` (NCCL-tests' ``-b -e -f``)."""
    if not 0 < min_bytes <= max_bytes or factor < 2:
        raise ValueError(f"sizes: need 0 < min ({min_bytes}) <= max ({max_bytes}) and factor >= 2")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def gather_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """A couple of logits-sized all-gathers inside the sweep: 64 KiB (batch 1 x 32k vocab x
    2 bytes), 1 MiB and 4 MiB (batch 8 x 128k vocab x 4 bytes); the largest size if none fits."""
    inside = [s for s in (64 * KiB, MiB, 4 * MiB) if min_bytes <= s <= max_bytes]
    return inside or [max_bytes]


@dataclass(frozen=True, slots=True)
class Result:
    op: str  # all_reduce | all_gather
    bytes: int  # all_reduce: the tensor; all_gather: the gathered output (world_size parts)
    dtype: str
    median_us: float
    p90_us: float
    algbw: float  # GB/s (1e9 bytes/s), from the median
    busbw: float  # GB/s: algbw x bus_factor(op, world_size)
    times_us: list[float]  # per timed iteration, the slowest rank's

    def row(self) -> list[str]:
        return [self.op, str(self.bytes), format_bytes(self.bytes), f"{self.median_us:,.1f}",
                f"{self.p90_us:,.1f}", f"{self.algbw:.3g}", f"{self.busbw:.3g}"]


HEADERS = ["op", "size (B)", "size", "median (us)", "p90 (us)", "algbw (GB/s)", "busbw (GB/s)"]


def result(op: str, nbytes: int, dtype: str, world_size: int, times_s: Sequence[float]) -> Result:
    from modserve.bench.metrics import percentile

    median = percentile(times_s, 50)
    algbw = nbytes / median / 1e9
    return Result(op, nbytes, dtype, median * 1e6, percentile(times_s, 90) * 1e6, algbw,
                  algbw * bus_factor(op, world_size), [t * 1e6 for t in times_s])


# -- the ranks ------------------------------------------------------------------------------------
def _worker(rank: int, world_size: int, backend: str, init_method: str, device: str, dtype: str,
            plan: list[tuple[str, int]], warmups: int, repeats: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=5))
    try:
        runs = [_collective(op, nbytes, getattr(torch, dtype), dev, world_size) for op, nbytes in plan]
        times: list[list[float]] = [[] for _ in plan]
        started = time.perf_counter()
        for i in range(warmups + repeats):  # every size once per iteration (see the module's docstring)
            for run, ts in zip(runs, times):
                t = _time_once(run, dev)
                if i >= warmups:
                    ts.append(t)
            if rank == 0:
                what = "warm-up" if i < warmups else "timed"
                print(f"[{i + 1}/{warmups + repeats}] {what} iteration over {len(plan)} sizes, "
                      f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        slowest = torch.tensor(times, dtype=torch.float64, device=dev)  # [sizes, repeats]
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            results = [asdict(result(op, nbytes, dtype, world_size, ts))
                       for (op, nbytes), ts in zip(plan, slowest.cpu().tolist())]
            Path(out_path).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _collective(op: str, nbytes: int, dtype: Any, dev: Any, world_size: int) -> Callable[[], None]:
    """One collective of ``nbytes``, ready to run. Zeros: sums stay finite however often repeated."""
    import torch
    import torch.distributed as dist

    elem = torch.empty(0, dtype=dtype).element_size()
    if op == "all_reduce":
        x = torch.zeros(nbytes // elem, dtype=dtype, device=dev)
        return lambda: dist.all_reduce(x)
    # NOTE: gloo has the list form only (dist.all_gather_into_tensor is NCCL's)
    part = torch.zeros(nbytes // elem // world_size, dtype=dtype, device=dev)
    parts = [torch.empty_like(part) for _ in range(world_size)]
    return lambda: dist.all_gather(parts, part)


def _time_once(run: Callable[[], None], dev: Any) -> float:
    """Seconds of one ``run`` on this rank, started after a barrier."""
    import torch
    import torch.distributed as dist

    cuda = dev.type == "cuda"
    dist.barrier(device_ids=[dev.index]) if cuda else dist.barrier()
    if cuda:
        torch.cuda.synchronize(dev)
    start = time.perf_counter()
    run()
    if cuda:
        torch.cuda.synchronize(dev)
    return time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the driver -----------------------------------------------------------------------------------
def rounded(nbytes: int, elem: int, parts: int) -> int:
    """The bytes actually sent: whole elements, split evenly into ``parts``."""
    unit = elem * parts
    return max(unit, nbytes // unit * unit)


def measure(world_size: int = 2, device: str = "cpu", sizes: Sequence[int] = (), gathers: Sequence[int] = (),
            dtype: str | None = None, warmups: int = 5, repeats: int = 20) -> dict[str, Any]:
    """Spawn ``world_size`` ranks over loopback (gloo on CPU, NCCL on CUDA), time every
    all-reduce size then every all-gather size; returns ``{"meta": ..., "results": [...]}``."""
    import torch
    import torch.multiprocessing as mp

    from modserve.bench.report import hardware_line

    if world_size < 2:
        raise ValueError("world size must be at least 2: a collective of one rank moves nothing")
    if repeats < 1 or warmups < 0:
        raise ValueError(f"need at least 1 timed iteration and no negative warm-ups, not {repeats} and {warmups}")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"--device cuda needs {world_size} GPUs, found {torch.cuda.device_count()}")
    backend = "nccl" if device == "cuda" else "gloo"
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    elem = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    plan = ([("all_reduce", rounded(s, elem, 1)) for s in sizes]
            + [("all_gather", rounded(s, elem, world_size)) for s in gathers])
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    print(f"bench collectives: {backend}, {world_size} ranks, {dtype}, {len(plan)} sizes x "
          f"({warmups} warm-up + {repeats} timed) iterations", file=sys.stderr, flush=True)
    load = os.getloadavg()[0]  # before the ranks add theirs: other work on the cores skews CPU figures
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.spawn(_worker, args=(world_size, backend, init_method, device, dtype, plan, warmups, repeats, out),
                 nprocs=world_size, join=True)
        results = json.loads(Path(out).read_text())
    meta = {"machine": hardware_line(), "host": platform.node(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "backend": backend, "device": device, "world_size": world_size, "dtype": dtype,
            "torch": torch.__version__, "warmups": warmups, "repeats": repeats,
            "cores": len(os.sched_getaffinity(0)), "threads_per_rank": 1,
            "loadavg_1m": round(load, 2),
            "wall_s": round(time.perf_counter() - started, 2),
            "units": {"bytes": "B (all_gather: the gathered output)", "median_us": "us", "p90_us": "us",
                      "algbw": "GB/s = 1e9 B/s, bytes / median time",
                      "busbw": "GB/s, algbw x 2(n-1)/n (all_reduce) or (n-1)/n (all_gather)"}}
    return {"meta": meta, "results": results}


def lines(data: dict[str, Any]) -> list[str]:
    from modserve.bench.report import table

    m = data["meta"]
    rows = [Result(**r).row() for r in data["results"]]
    return [f"machine: {m['machine']}, torch {m['torch']}, load average {m.get('loadavg_1m', '?')}",
            f"backend {m['backend']}, world size {m['world_size']}, {m['dtype']}, 1 thread per rank; "
            f"median and p90 over {m['repeats']} iterations ({m['warmups']} warm-up), the slowest rank's",
            table(HEADERS, rows),
            "algbw = size / median time; busbw = algbw x 2(n-1)/n (all_reduce), x (n-1)/n (all_gather), "
            "as NCCL-tests"]


def plot(data: dict[str, Any], path: str | Path) -> str | None:
    """Latency (median, p90 band) and busbw vs size, log-log; returns why not if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = data["meta"]
    fig, (lat, bw) = plt.subplots(1, 2, figsize=(10, 4))
    for op in OPS:
        rs = [r for r in data["results"] if r["op"] == op]
        if not rs:
            continue
        x = [r["bytes"] for r in rs]
        (line,) = lat.plot(x, [r["median_us"] for r in rs], marker="o", label=f"{op} median")
        lat.fill_between(x, [r["median_us"] for r in rs], [r["p90_us"] for r in rs], color=line.get_color(),
                         alpha=0.2, label=f"{op} to p90")
        bw.plot(x, [r["busbw"] for r in rs], marker="o", color=line.get_color(), label=op)
    for ax in (lat, bw):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
    lat.set_yscale("log")
    lat.set(title="latency", xlabel="message size (bytes)", ylabel="us")
    bw.set(title="bus bandwidth", xlabel="message size (bytes)", ylabel="busbw (GB/s)")
    load = f", load average {m['loadavg_1m']}" if m.get("device") == "cpu" and "loadavg_1m" in m else ""
    fig.suptitle(f"{m['backend']}, world size {m['world_size']}, {m['dtype']} · {m['machine']}{load} · "
                 f"{m['date'][:10]}", fontsize="medium")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def load_curve(path: str | Path) -> dict[str, Any]:
    """A ``--json`` file of this command, checked: what ``modserve plan --allreduce-json`` reads."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "meta" not in data or not any(r.get("op") == "all_reduce"
                                                                   for r in data.get("results", [])):
        raise ValueError(f"{path}: not a 'modserve bench collectives --json' file with all_reduce results")
    return data


def interpolate(points: Sequence[tuple[float, float]], nbytes: float) -> float:
    """Time of a message of ``nbytes`` from measured (bytes, seconds): linear between the
    measured sizes; below the smallest, the smallest's time (a latency floor); above the
    largest, the largest's bandwidth."""
    pts = sorted(points)
    if nbytes <= pts[0][0]:
        return pts[0][1]
    if nbytes >= pts[-1][0]:
        return pts[-1][1] * nbytes / pts[-1][0]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= nbytes <= x1:
            return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)
    return math.nan  # unreachable
