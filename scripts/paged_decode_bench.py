"""Time the paged decode-attention kernel alone: B sequences of L cached tokens.

Random queries and a random bf16 (or float32) cache whose blocks are shuffled through the
pool, as a running server's are; the small model's heads by default (12 query heads, 4
KV heads, head_dim 64). Each variant is a build of the kernel at a vector width: ``16``
and ``8`` are this build's two paths (16 only where it has AVX-512), ``old`` (with
``--old SOURCE``) another source whose ops are registered under ``modserve_paged_old``.
Variants are called in turn, round after round, so a load that comes and goes on a
shared machine falls on all alike, each call on the next layer's cache (a variant never
finds its KV warm from the call before it); the medians are printed, and the minimums (the
figure least disturbed where other jobs take the cores: a call preempted for a time slice
lasts milliseconds longer).

    .venv/bin/python scripts/paged_decode_bench.py --batch 1 16 64 --len 250 --variants 16 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--len", type=int, default=250, help="cached tokens per sequence")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cache-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--layers", type=int, default=12, help="caches cycled through, as a model's layers are")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--blocks", choices=["shuffled", "in-order"], default="shuffled",
                    help="a sequence's blocks scattered through the pool, or consecutive (a fresh server's)")
    ap.add_argument("--variants", nargs="+", default=["16", "8"])
    ap.add_argument("--old", help="another kernel source, its ops registered as modserve_paged_old")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: the calling thread's CPU time, which leaves out time slices other jobs take "
                         "(one thread only: OMP_NUM_THREADS=1)")
    args = ap.parse_args()
    import torch

    from modserve.api.cpp import load_kernel
    from modserve.attention_backends import DECODE_KERNEL

    assert load_kernel("modserve_paged_decode", str(DECODE_KERNEL)) is None
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        ap.error("--clock cpu counts the calling thread alone: run with OMP_NUM_THREADS=1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    widest = torch.ops.modserve_paged.vector_width()
    calls = {}
    for v in args.variants:
        if v == "old":
            assert args.old and load_kernel("modserve_paged_old", args.old) is None
            calls[v] = torch.ops.modserve_paged_old.decode
        elif int(v) <= widest:
            calls[v] = lambda *a, w=int(v): torch.ops.modserve_paged.decode(*a, width=w)
    print(f"threads {torch.get_num_threads()}, {args.clock} clock, load average {os.getloadavg()[0]:.2f}, "
          f"widest build {widest}")
    print("| sequences | " + " | ".join(f"{v}: median, min (us)" for v in calls) + " | KV GB/s (first, min) |")
    print("|---|" + "---|" * len(calls) + "---|")
    dtype = getattr(torch, args.cache_dtype)
    H, Hkv, D, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    for B in args.batch:
        per_seq = -(-args.len // bs)
        caches = []
        for _ in range(args.layers):  # [blocks, Hkv, bs, D], each sequence's blocks scattered
            blocks = B * per_seq
            k = torch.randn(blocks, Hkv, bs, D).to(dtype)
            v = torch.randn(blocks, Hkv, bs, D).to(dtype)
            order = torch.randperm(blocks) if args.blocks == "shuffled" else torch.arange(blocks)
            tables = order.view(B, per_seq)
            caches.append((torch.randn(B, H, D), k, v, tables))
        lens = torch.full((B,), args.len, dtype=torch.long)
        times: dict[str, list[float]] = {v: [] for v in calls}
        for r in range(args.rounds):
            for i, (v, call) in enumerate(calls.items()):
                # the next layer's cache for every call: a variant never finds its KV warm from the last
                q, k, vc, tables = caches[(r * len(calls) + i) % args.layers]
                start = clock()
                call(q, k, vc, tables, lens, D**-0.5)
                times[v].append(clock() - start)
        kept = {v: t[args.rounds // 10 :] for v, t in times.items()}  # the first rounds warm caches up
        med = {v: statistics.median(t) * 1e6 for v, t in kept.items()}
        low = {v: min(t) * 1e6 for v, t in kept.items()}
        first = next(iter(med))
        kv_bytes = 2 * B * args.len * Hkv * D * dtype.itemsize
        print(f"| {B} | " + " | ".join(f"{med[v]:.0f}, {low[v]:.0f}" for v in calls)
              + f" | {kv_bytes / low[first] / 1e3:.1f} |", flush=True)
    print(f"load average after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
