"""The pipeline bubble a benchmark run saw: each stage's idle fraction, 1 - (wall time inside
its layers) / (the run's wall time). Busy time is what every rank adds up in its runner
(``ModelRunner.stage_seconds``), read through one message to every rank (``LLM.stage_times``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StageClock:
    """Each rank's busy seconds and the wall clock at one moment."""

    busy: list[float]  # by global rank
    wall: float

    @classmethod
    def read(cls, llm: Any) -> StageClock | None:
        """None without pipeline stages."""
        if llm.config.pipeline_parallel_size == 1:
            return None
        return cls(llm.stage_times(), time.perf_counter())


def idle_fractions(start: StageClock, end: StageClock, tp_size: int) -> list[float]:
    """Per stage (its tensor-parallel rank 0): the share of the wall time it was not in its layers."""
    wall = max(end.wall - start.wall, 1e-9)
    return [max(0.0, 1.0 - (end.busy[r] - start.busy[r]) / wall) for r in range(0, len(end.busy), tp_size)]


def bubble_line(idle: list[float], in_flight: bool) -> str:
    stages = ", ".join(f"stage {i} {f:.0%}" for i, f in enumerate(idle))
    how = "batches in flight" if in_flight else "one step at a time (--no-pipeline-in-flight)"
    return f"pipeline bubble (idle fraction of the wall time, warm-ups included; {how}): {stages}"
