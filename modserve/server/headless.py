"""``modserve serve MODEL --headless``: this machine's engine cores of a data-parallel set whose
API server runs on another machine (vLLM's --headless). No HTTP server here.

Ranks ``--data-parallel-start-rank`` to ``+ --data-parallel-size-local - 1`` each start as an
engine-core process (the same code as the API server's own cores), handshake with the server
at ``--data-parallel-address:--data-parallel-rpc-port`` and then take its commands.

This process supervises them and nothing more: once one of its cores ends (the API server
stopped them, the server went away, or the core died), or on SIGTERM/SIGINT, it stops the
others and exits (0 when every core ended cleanly or a signal asked it to, else 1). Its cores
die with it (PR_SET_PDEATHSIG), so nothing of it outlives a `kill -9` either.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from typing import Any

from modserve.core.config import EngineConfig
from modserve.engine.core_handshake import fingerprint
from modserve.engine.core_process import LaunchSpec
from modserve.server.core_launch import spawn_core
from modserve.server.remote_cores import ready_timeout
from modserve.server.rank_configs import replica_config

logger = logging.getLogger("modserve.server")

POLL_S = 0.2
STOP_GRACE_S = 5.0  # a core asked to stop (SIGTERM) is killed after this


def run_headless(config: EngineConfig, size_local: int, start_rank: int, address: str, port: int) -> int:
    """Run this node's cores until they end; the process's exit status."""
    size = config.data_parallel_size
    if size_local < 1 or not 0 <= start_rank or start_rank + size_local > size:
        raise SystemExit(f"--headless: ranks {start_rank}..{start_rank + size_local - 1} "
                         f"(--data-parallel-start-rank, --data-parallel-size-local) are not ranks of "
                         f"--data-parallel-size {size}")
    handshake = f"tcp://{address}:{port}"
    configs = node_configs(config, start_rank, size_local)
    expected = fingerprint(config)
    cores: dict[int, subprocess.Popen] = {}
    for rank, c in enumerate(configs, start_rank):
        spec = LaunchSpec(c.model_dump_json(), rank, inbox="", outbox="", beats="", parent_pid=os.getpid(),
                          handshake=handshake, fingerprint=expected, ready_timeout=ready_timeout())
        cores[rank] = spawn_core(spec)
        logger.info("headless: engine core %d (pid %d) joins the API server at %s", rank, cores[rank].pid, handshake)
    asked = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: asked.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = _supervise(cores, asked)
    finally:
        _stop(cores)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


def node_configs(config: EngineConfig, first: int, count: int) -> list[EngineConfig]:
    """The configs of one machine's ranks ``first..first+count-1``: each rank's seed (seed +
    rank), and this machine's memory (and devices) shared by its ``count`` ranks alone."""
    node = config.model_copy(update={"data_parallel_size": count})
    configs = [replica_config(node, i) if count > 1 else node.model_copy(deep=True) for i in range(count)]
    for rank, c in enumerate(configs, first):
        c.seed = config.seed + rank
    return configs


def _supervise(cores: dict[int, subprocess.Popen], asked: threading.Event) -> int:
    while not asked.wait(POLL_S):
        for rank, proc in cores.items():
            if (code := proc.poll()) is not None:
                how = "ended" if code == 0 else f"exited with code {code}"
                logger.log(logging.INFO if code == 0 else logging.ERROR,
                           "headless: engine core %d %s: stopping this node's other cores", rank, how)
                return 0 if code == 0 and all(p.poll() in (None, 0) for p in cores.values()) else 1
    logger.info("headless: asked to stop: stopping this node's engine cores")
    return 0


def _stop(cores: dict[int, Any]) -> None:
    """SIGTERM each core's process group (its workers too), SIGKILL what is left after the grace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in cores.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        for proc in cores.values():
            try:
                proc.wait(STOP_GRACE_S if sig == signal.SIGTERM else None)
            except subprocess.TimeoutExpired:
                pass
