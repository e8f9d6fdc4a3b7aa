"""The model's collectives time out after the step deadline (collective_timeout), while a
worker still waits for the next step's metadata as long as the engine idles.

Two real gloo ranks in two processes: rank 1 joins, then waits on the metadata broadcast
that rank 0 sends only after the collectives' timeout has passed (that wait must not time
out); rank 0 first enters an all-reduce rank 1 never joins, which must fail after about the
timeout instead of waiting.
"""

from __future__ import annotations

import subprocess
import sys

from server_process import free_port

TIMEOUT_S = 2.0
RANK = r"""
import sys, time
import torch
from modserve.runner.parallel import collective_timeout, init_parallel
rank, init_method, timeout = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
tp, _ = init_parallel("gloo", init_method, rank, 2, timeout=collective_timeout(timeout))
if rank == 0:
    began = time.monotonic()
    try:
        tp.all_reduce(torch.ones(4))
        print("all_reduce returned", flush=True)
    except RuntimeError:
        print(f"all_reduce failed after {time.monotonic() - began:.1f} s", flush=True)
    tp.broadcast("next step")
else:
    print("rank 1 got", tp.broadcast(), flush=True)
"""


def test_a_collective_a_peer_never_joins_fails_after_the_step_deadline_and_idle_waits_do_not():
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), init_method, str(TIMEOUT_S)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        out = [p.communicate(timeout=60)[0] for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [line for line in out[0].splitlines() if line.startswith("all_reduce")]
    assert failed and failed[0].startswith("all_reduce failed after"), out
    assert TIMEOUT_S - 0.5 <= float(failed[0].split()[3]) < TIMEOUT_S + 10, out
    assert "rank 1 got next step" in out[1], out  # it waited past the collectives' timeout
