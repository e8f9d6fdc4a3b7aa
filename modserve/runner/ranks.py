"""Tensor-parallel ranks: rank 0 in the engine's process, the others started by an executor
(each runs :func:`modserve.api.run_worker`).

Every rank holds its shard of the model and of the KV cache. Rank 0 alone schedules and
samples; each runner call the others must make too it first broadcasts on the ranks' gloo
group as a message of :mod:`modserve.runner.messages`: one message per step.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import torch.distributed as dist

from modserve.core.config import EngineConfig
from modserve.core.contracts.executor import Executor, WorkerSpec
from modserve.core.contracts.platform import Platform
from modserve.runner.messages import Stop
from modserve.runner.parallel import PipelineStage, TensorParallel, collective_timeout, init_parallel
from modserve.core.registry import Registry

logger = logging.getLogger("modserve")

STOP_SEND_TIMEOUT_S = 5.0  # a worker that has not taken the stop by then is frozen: the executor kills it
ENV_PREFIXES = ("MODSERVE_", "OMP_", "MKL_", "TORCHINDUCTOR_", "CUDA_VISIBLE_DEVICES")


def start_ranks(config: EngineConfig, registry: Registry,
                platform: Platform) -> tuple[Executor, TensorParallel, PipelineStage]:
    """Start ranks 1..N-1 through the configured executor and join rank 0 to their group."""
    world = config.world_size
    executor: Executor = registry.create("executor", config.executor_choice())
    if world == 1:
        return executor, TensorParallel(), PipelineStage()
    host = executor.rendezvous_host()
    init_method = f"tcp://{host}:{rendezvous_port(config, host)}"
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    specs = [WorkerSpec(config.model_dump(), rank, world, init_method, platform.distributed_backend,
                        registry.sources(), env) for rank in range(1, world)]
    logger.info("%s (%s executor, %s), rendezvous at %s", rank_layout(config), config.executor_choice().name,
                platform.distributed_backend, init_method)
    start = time.monotonic()
    try:
        executor.start(specs)
        tp, pp = init_parallel(platform.distributed_backend, init_method, 0, config.tensor_parallel_size,
                               config.pipeline_parallel_size, executor.failed, collective_timeout(config.step_timeout))
    except Exception:
        executor.shutdown()
        raise
    logger.info("%s joined in %.1f s", rank_layout(config), time.monotonic() - start)
    return executor, tp, pp


def rank_layout(config: EngineConfig) -> str:
    """What the ranks are, for the log: ``-pp 2`` is pipeline stages, not tensor ranks."""
    return (f"{config.world_size} ranks: {config.pipeline_parallel_size} pipeline stage(s) x "
            f"{config.tensor_parallel_size} tensor-parallel rank(s)")


def stop_ranks(executor: Executor, tp: TensorParallel, world_size: int, tell: bool = True) -> None:
    """Tell the workers to stop (unless ``tell`` is False: they are inside a call rank 0 left),
    leave the group, and let the executor reap their processes."""
    if world_size == 1:
        executor.shutdown()
        return
    sender = _send_stop(tp) if tell and executor.failed() is None else None
    if sender is not None:
        # NOTE: the workers leave the group before rank 0's (with its rendezvous store) goes. A
        # worker that has not taken the stop is frozen: the executor kills it, and the send ends.
        executor.shutdown()
        sender.join(STOP_SEND_TIMEOUT_S)
        if dist.is_initialized() and not sender.is_alive():
            dist.destroy_process_group()
        return
    if dist.is_initialized():
        dist.destroy_process_group()  # untold workers, waiting on rank 0's sockets, end now
    executor.shutdown()


def _send_stop(tp: TensorParallel) -> threading.Thread:
    """Broadcast :class:`Stop` from a thread, waiting for it at most STOP_SEND_TIMEOUT_S: a frozen
    worker never takes it, and the executor must get the chance to kill it."""
    def send() -> None:
        try:
            tp.broadcast(Stop())
        except Exception as e:  # a worker already gone: the executor reaps the rest
            logger.warning("tensor parallel: could not tell every worker to stop: %s", e)

    sender = threading.Thread(target=send, name="modserve-stop-ranks", daemon=True)
    sender.start()
    sender.join(STOP_SEND_TIMEOUT_S)
    if sender.is_alive():
        logger.warning("tensor parallel: a worker did not take the stop within %g s", STOP_SEND_TIMEOUT_S)
    return sender


def rendezvous_port(config: EngineConfig, host: str) -> int:
    """``master_port`` when configured (vLLM's name), else a port free on ``host`` now."""
    return config.master_port if config.master_port is not None else _free_port(host)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
