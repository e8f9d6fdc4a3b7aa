"""Pinning a benchmark to CPU cores and a thread count, so that runs are comparable."""

from __future__ import annotations

import argparse
import os


def parse_cpus(spec: str) -> set[int]:
    """``"0-3,6"`` -> ``{0, 1, 2, 3, 6}``."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def add_pinning_flags(parser: argparse.ArgumentParser, warmups: str = "untimed runs first",
                      repeats: str = "timed runs; figures are median [min-max]") -> None:
    """``--repeats``, ``--warmups`` (vLLM's ``--num-iters``, ``--num-warmups``, ``--num-iters-warmup``
    are aliases) and ``--cpus``. Torch threads are the engine flag ``--num-threads`` (``--threads``)."""
    g = parser.add_argument_group("repeats and pinning")
    g.add_argument("--repeats", "--num-iters", type=int, default=3, help=repeats)
    g.add_argument("--warmups", "--num-warmups", "--num-iters-warmup", type=int, default=1, help=warmups)
    g.add_argument("--cpus", default=None, help="pin the process to these cores, e.g. 0-3")


def pin(args: argparse.Namespace) -> str:
    """Apply ``--cpus`` and the engine flag ``--num-threads`` (if the command has engine flags);
    returns a line saying what the run uses. Commands without engine flags run no torch and
    don't import it."""
    if args.cpus:
        os.sched_setaffinity(0, parse_cpus(args.cpus))
    cores = sorted(os.sched_getaffinity(0))
    where = f"{len(cores)} cores ({_ranges(cores)})"
    if not hasattr(args, "cfg_num_threads"):
        return where
    import torch

    if args.cfg_num_threads:
        torch.set_num_threads(int(args.cfg_num_threads))
    return f"{torch.get_num_threads()} torch threads on {where}"


def _ranges(cores: list[int]) -> str:
    out, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)
