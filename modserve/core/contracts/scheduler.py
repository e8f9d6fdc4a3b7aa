"""The scheduler policy's contract (config key ``scheduler``): which sequences run next,
with how many tokens each, given the engine's limits and its read-only view of the queues.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence as Seq

from pydantic import BaseModel

from modserve.core.sequence import Sequence


@dataclass(slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(slots=True)
class Schedule:
    """What a scheduling policy decided for one step.

    ``tokens[seq]`` is how many of ``seq``'s uncomputed tokens to compute now;
    ``preempt`` lists running sequences to evict (their blocks freed, progress reset).
    """

    tokens: dict[Sequence, int] = field(default_factory=dict)
    preempt: list[Sequence] = field(default_factory=list)


class SchedulerView(ABC):
    """What a policy may read: the core's queues, limits and block budget."""

    waiting: Seq[Sequence]  # arrival order (sequences preempted by recompute go back in front)
    running: Seq[Sequence]  # admission order
    swapped: Seq[Sequence]  # preempted by swap, in preemption order; resume by scheduling them
    limits: SchedulerLimits

    @abstractmethod
    def free_blocks(self) -> int: ...

    @abstractmethod
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks that computing ``num_new_tokens`` more tokens of ``seq`` takes."""

    @abstractmethod
    def blocks_freed_by(self, seq: Sequence) -> int:
        """Blocks that preempting ``seq`` gives back."""

    def cached_tokens(self, seq: Sequence) -> int:
        """Tokens of waiting ``seq``'s prompt the prefix cache holds now (what admitting it
        would skip). Default: 0, a view without a prefix cache."""
        return 0


class Scheduler(ABC):
    """A scheduling policy: picks which sequences run each step and how far.

    Contract: ``schedule`` only reads ``view``. The core validates the result
    (known sequences, within ``max_num_seqs`` and ``max_num_batched_tokens``,
    blocks available after the preemptions) and rejects an invalid one with an
    error naming the plugin. Sequences not mentioned simply wait this step.
    """

    def __init__(self, limits: SchedulerLimits, options: BaseModel | None = None) -> None:
        self.limits = limits
        self.options = options

    @abstractmethod
    def schedule(self, view: SchedulerView) -> Schedule: ...
