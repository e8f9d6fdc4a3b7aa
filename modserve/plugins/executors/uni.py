"""uni: the engine's own process is the only rank; no worker, nothing to watch."""

from __future__ import annotations

from modserve.api import Executor, WorkerSpec


class UniExecutor(Executor):
    def start(self, workers: list[WorkerSpec]) -> None:
        raise ValueError(f"the uni executor runs one rank, not {len(workers) + 1}: set "
                         "distributed_executor_backend to mp or ray for tensor_parallel_size > 1")

    def failed(self) -> str | None:
        return None

    def shutdown(self) -> None:
        pass
