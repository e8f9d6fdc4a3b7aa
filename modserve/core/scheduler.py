"""The core side of scheduling: queues, token budget, blocks. Policies only decide.

A scheduling policy (a ``Scheduler`` plugin) reads this object through the
``SchedulerView`` interface and returns a ``Schedule``; :meth:`SchedulerCore.step`
checks it in full before changing anything, so a faulty policy cannot leave the
queues or the allocator in a broken state.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from modserve.core.interfaces import KVAllocator, Schedule, Scheduler, SchedulerLimits, SchedulerView
from modserve.core.registry import PluginError
from modserve.core.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledStep:
    seqs: list[Sequence]
    num_new_tokens: list[int]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class SchedulerCore(SchedulerView):
    def __init__(self, policy: Scheduler, allocator: KVAllocator, limits: SchedulerLimits, policy_name: str) -> None:
        self.policy = policy
        self.allocator = allocator
        self.limits = limits
        self.policy_name = policy_name
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- SchedulerView --------------------------------------------------------
    def free_blocks(self) -> int:
        return self.allocator.num_free_blocks()

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return self.allocator.blocks_needed(seq, seq.num_computed_tokens + num_new_tokens)

    # -- queue changes ----------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.allocator.free(seq)
        seq.status = SequenceStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------
    def step(self) -> ScheduledStep:
        schedule = self.policy.schedule(self)
        self._check(schedule)
        for seq in schedule.preempt:
            self._preempt(seq)
        seqs, counts = [], []
        for seq, n in schedule.tokens.items():
            if seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = SequenceStatus.RUNNING
            if not self.allocator.allocate(seq, seq.num_computed_tokens + n):
                raise PluginError(f"kv allocator could not allocate what it reported free for sequence {seq.seq_id}")
            seqs.append(seq)
            counts.append(n)
        return ScheduledStep(seqs, counts, list(schedule.preempt))

    def _preempt(self, seq: Sequence) -> None:
        # Recompute: drop the KV, keep the tokens; the sequence is prefilled again later.
        self.running.remove(seq)
        self.allocator.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _check(self, schedule: Schedule) -> None:
        def refuse(why: str) -> PluginError:
            return PluginError(f"scheduler {self.policy_name!r} returned an invalid schedule: {why}")

        running = set(self.running)
        waiting = set(self.waiting)
        preempt = set(schedule.preempt)
        if not preempt <= running:
            raise refuse("it preempts a sequence that is not running")
        total = 0
        blocks = 0
        freed = sum(len(s.block_ids) for s in preempt)
        for seq, n in schedule.tokens.items():
            if seq in preempt or not (seq in running or seq in waiting):
                raise refuse(f"sequence {seq.seq_id} is neither running nor waiting")
            remaining = seq.num_tokens - (0 if seq in preempt else seq.num_computed_tokens)
            if not 1 <= n <= remaining:
                raise refuse(f"sequence {seq.seq_id} gets {n} tokens, it has {remaining} to compute")
            total += n
            blocks += self.blocks_needed(seq, n)
        if total > self.limits.max_num_batched_tokens:
            raise refuse(f"{total} tokens exceed max_num_batched_tokens={self.limits.max_num_batched_tokens}")
        admitted = sum(1 for s in schedule.tokens if s in waiting)
        if len(running) - len(preempt) + admitted > self.limits.max_num_seqs:
            raise refuse(f"more than max_num_seqs={self.limits.max_num_seqs} running sequences")
        if blocks > self.free_blocks() + freed:
            raise refuse(f"needs {blocks} KV blocks, {self.free_blocks() + freed} are free")
