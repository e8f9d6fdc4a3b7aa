"""The executor's contract (config key ``executor``): start and watch the ranks > 0 in
processes of their own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel


@dataclass(slots=True)
class WorkerSpec:
    """What one tensor-parallel rank > 0 needs to start: ``modserve.api.run_worker(spec)``."""

    config: dict[str, Any]  # the engine's EngineConfig, as model_dump()
    rank: int
    world_size: int
    init_method: str  # tcp://host:port of rank 0's rendezvous
    backend: str  # gloo, nccl: the platform's
    plugins: list[str]  # distributions whose plugins the driver loaded: the worker loads the same
    env: dict[str, str] = field(default_factory=dict)  # the driver's MODSERVE_* and thread settings


class Executor(ABC):
    """Runs the model's tensor-parallel ranks 1..N-1 in processes of their own (rank 0 is the
    engine's process) and watches them.

    Contract: ``start(workers)`` returns once each ``modserve.api.run_worker(spec)`` is under
    way in a process of its own (it blocks until rank 0 stops it, so do not wait for it); the
    core then joins rank 0 to their group at ``rendezvous_host()``. ``failed()`` is polled by
    the engine (cheap, never blocking): why a worker is gone, or None. ``shutdown()`` runs
    after rank 0 told the workers to stop: wait a little, then kill what is left; no process
    may outlive it. A world of one rank never calls ``start``.
    """

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options

    def rendezvous_host(self) -> str:
        """An address of this process's machine that every worker can reach."""
        return "127.0.0.1"

    @abstractmethod
    def start(self, workers: list[WorkerSpec]) -> None: ...

    @abstractmethod
    def failed(self) -> str | None: ...

    @abstractmethod
    def shutdown(self) -> None: ...
