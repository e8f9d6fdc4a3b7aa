"""A scheduling policy run step by step against a fake engine: queues, limits and a block pool.

:class:`FakeSchedulerView` is what a policy sees (the core's queues over plain
:class:`~modserve.api.Sequence` objects, one block per ``block_size`` tokens computed or
scheduled). :class:`SchedulerSim` checks each schedule as the core would refuse it, applies it
(preemptions free blocks; computed tokens advance; a sequence that reaches its last token
samples one more; one with all its output tokens finishes), and runs until every sequence
finished.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from modserve.api import SamplingParams, Schedule, Scheduler, SchedulerLimits, SchedulerView, Sequence, SequenceStatus


class FakeSchedulerView(SchedulerView):
    def __init__(self, limits: SchedulerLimits, num_blocks: int, block_size: int) -> None:
        self.limits = limits
        self.num_blocks, self.block_size = num_blocks, block_size
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.held: dict[int, int] = {}  # seq_id -> blocks held

    def free_blocks(self) -> int:
        return self.num_blocks - sum(self.held.values())

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - self.held.get(seq.seq_id, 0))

    def blocks_freed_by(self, seq: Sequence) -> int:
        return self.held.get(seq.seq_id, 0)

    def snapshot(self) -> tuple:
        """Everything a policy could change: queues, progress, tokens, blocks."""
        seqs = [*self.waiting, *self.running, *self.swapped]
        return ([s.seq_id for s in self.waiting], [s.seq_id for s in self.running], [s.seq_id for s in self.swapped],
                [(s.seq_id, s.num_computed_tokens, len(s.token_ids), s.status) for s in seqs], dict(self.held))


@dataclass(frozen=True)
class Capacity:
    """The engine's limits and block pool in a simulation."""

    name: str
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    block_size: int = 4
    max_model_len: int = 64


TIGHT = Capacity("tight", max_num_seqs=4, max_num_batched_tokens=8, num_blocks=20)  # one long sequence fills it
LOOSE = Capacity("loose", max_num_seqs=16, max_num_batched_tokens=256, num_blocks=256)


class SchedulerSim:
    def __init__(self, policy: Scheduler, capacity: Capacity, preemption: str, seed: int) -> None:
        self.policy, self.capacity, self.preemption = policy, capacity, preemption
        limits = SchedulerLimits(capacity.max_num_seqs, capacity.max_num_batched_tokens, capacity.max_model_len)
        self.view = FakeSchedulerView(limits, capacity.num_blocks, capacity.block_size)
        rng = random.Random(seed)
        self.arrivals: list[tuple[int, Sequence]] = []  # (step, sequence), by step
        self.output_len: dict[int, int] = {}
        now = time.perf_counter()
        for i in range(12):
            prompt = rng.randint(1, 40)
            self.output_len[i] = rng.randint(1, capacity.max_model_len - prompt)
            seq = Sequence(i, f"r{i}", [rng.randrange(100) for _ in range(prompt)], prompt, SamplingParams(),
                           now + i * 1e-3, priority=rng.randint(0, 2))
            self.arrivals.append((rng.randint(0, 10) if i else 0, seq))
        self.arrivals.sort(key=lambda a: a[0])
        self.finished: list[Sequence] = []
        self.step_index = 0

    def run(self, max_steps: int = 3000, max_idle: int = 3) -> None:
        idle = 0
        while len(self.finished) < len(self.output_len):
            assert self.step_index < max_steps, (
                f"after {max_steps} steps, sequences {self.unfinished()} have not finished: the policy starves them")
            for step, seq in [a for a in self.arrivals if a[0] == self.step_index]:
                seq.status = SequenceStatus.WAITING
                self.view.waiting.append(seq)
            did = self.step()
            idle = 0 if did or not (self.view.waiting or self.view.running or self.view.swapped) else idle + 1
            assert idle < max_idle, (
                f"steps {self.step_index - idle + 1}..{self.step_index}: nothing scheduled or preempted while "
                f"{len(self.view.running)} sequences run, {len(self.view.waiting)} wait and {len(self.view.swapped)} "
                f"are swapped out ({self.capacity.num_blocks - self.view.free_blocks()} of {self.capacity.num_blocks} "
                f"blocks held): the engine would spin forever")
            self.step_index += 1

    def unfinished(self) -> list[int]:
        done = {s.seq_id for s in self.finished}
        return [i for i in self.output_len if i not in done]

    def step(self) -> bool:
        view = self.view
        before = view.snapshot()
        schedule = self.policy.schedule(view)
        at = f"step {self.step_index} ({len(view.running)} running, {len(view.waiting)} waiting, " \
             f"{len(view.swapped)} swapped, {view.free_blocks()} free blocks, {self.capacity.name} budget)"
        assert view.snapshot() == before, f"{at}: schedule() changed the view; a policy only reads it"
        assert isinstance(schedule, Schedule), f"{at}: schedule() must return a Schedule, got {type(schedule).__name__}"
        self.check(schedule, at)
        self.apply(schedule)
        return bool(schedule.tokens or schedule.preempt)

    def check(self, schedule: Schedule, at: str) -> None:
        """What the core refuses (:meth:`SchedulerCore._check`), as assertions."""
        view, limits = self.view, self.view.limits
        running, queued = {id(s) for s in view.running}, {id(s) for s in (*view.waiting, *view.swapped)}
        preempt = {id(s) for s in schedule.preempt}
        assert len(preempt) == len(schedule.preempt), f"{at}: a sequence is preempted twice"
        strays = [s.seq_id for s in schedule.preempt if id(s) not in running]
        assert not strays, f"{at}: sequences {strays} are preempted but not running; only running ones can be"
        total = blocks = 0
        for seq, n in schedule.tokens.items():
            assert id(seq) not in preempt, f"{at}: sequence {seq.seq_id} is both preempted and scheduled"
            assert id(seq) in running or id(seq) in queued, f"{at}: sequence {seq.seq_id} is scheduled but unknown"
            assert isinstance(n, int) and 1 <= n <= seq.num_uncomputed, (
                f"{at}: sequence {seq.seq_id} gets {n!r} tokens; it has {seq.num_uncomputed} to compute (1 or more)")
            total += n
            blocks += view.blocks_needed(seq, n)
        assert total <= limits.max_num_batched_tokens, (
            f"{at}: the schedule computes {total} tokens, over max_num_batched_tokens={limits.max_num_batched_tokens}")
        admitted = sum(1 for s in schedule.tokens if id(s) not in running)
        after = len(view.running) - len(preempt) + admitted
        assert after <= limits.max_num_seqs, (
            f"{at}: {after} sequences would run, over max_num_seqs={limits.max_num_seqs}")
        free = view.free_blocks() + sum(view.blocks_freed_by(s) for s in schedule.preempt)
        assert blocks <= free, f"{at}: the schedule needs {blocks} new blocks; {free} are free after its preemptions"

    def apply(self, schedule: Schedule) -> None:
        view, bs = self.view, self.capacity.block_size
        for seq in schedule.preempt:
            view.running.remove(seq)
            view.held[seq.seq_id] = 0
            seq.num_preemptions += 1
            if self.preemption == "swap":  # its KV waits in host memory, progress kept
                seq.status = SequenceStatus.SWAPPED
                view.swapped.append(seq)
            else:  # recompute: back to the front of the queue, progress lost
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
                view.waiting.insert(0, seq)
        for seq, n in schedule.tokens.items():
            for queue in (view.waiting, view.swapped):
                if seq in queue:
                    queue.remove(seq)
            if seq.status is not SequenceStatus.RUNNING:
                view.running.append(seq)
                seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens += n
            view.held[seq.seq_id] = -(-seq.num_computed_tokens // bs)
            if seq.num_computed_tokens == seq.num_tokens:  # its last token computed: one is sampled
                seq.token_ids.append(self.step_index % 100)
                if seq.num_output_tokens >= self.output_len[seq.seq_id]:
                    view.running.remove(seq)
                    view.held[seq.seq_id] = 0
                    seq.status = SequenceStatus.FINISHED
                    self.finished.append(seq)
