"""Budget helpers for scheduling policies: advance running sequences, admit waiting ones,
preempt from the end of an order when blocks run short.

The built-in ``fcfs``, ``static`` and ``priority`` policies are these helpers plus an order;
a third-party policy reuses them the same way (see docs/writing-a-plugin.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from modserve.core.contracts.scheduler import Schedule, SchedulerView
from modserve.core.sequence import Sequence


@dataclass(slots=True)
class Budget:
    tokens: int
    blocks: int
    seqs: int  # free sequence slots


def chunk_size(seq: Sequence, budget: Budget, long_prefill: int) -> int:
    """Tokens ``seq`` computes this step: all it has left, within the step's budget and,
    with ``long_prefill`` > 0, at most that many of a prefill (a speculating decode's
    draft slots are not cut)."""
    n = min(seq.num_uncomputed, budget.tokens)
    return min(n, long_prefill) if long_prefill and not seq.num_lookahead else n


def advance_running(view: SchedulerView, order: list[Sequence], out: Schedule, budget: Budget,
                    chunk: bool = True, long_prefill: int = 0) -> None:
    """Give each running sequence in ``order`` its next tokens (a decode, or the next
    prefill chunk, of at most ``long_prefill`` tokens when that is set). When blocks run
    short, preempt from the end of ``order`` (the sequences the policy values least)
    until the current one fits."""
    order = list(order)
    i = 0
    while i < len(order) and budget.tokens > 0:
        seq = order[i]
        remaining = seq.num_uncomputed
        if not chunk and remaining > budget.tokens:
            i += 1
            continue
        n = chunk_size(seq, budget, long_prefill)
        need = view.blocks_needed(seq, n)
        while need > budget.blocks and order[-1] is not seq:
            victim = order.pop()
            out.preempt.append(victim)
            budget.blocks += view.blocks_freed_by(victim)
            budget.seqs += 1
        if need > budget.blocks:  # alone and still short: it waits for the others to finish
            order.pop()
            out.preempt.append(seq)
            budget.seqs += 1
            return
        out.tokens[seq] = n
        budget.tokens -= n
        budget.blocks -= need
        i += 1


def admit(view: SchedulerView, candidates: Iterable[Sequence], out: Schedule, budget: Budget,
          chunk: bool = True, long_prefill: int = 0) -> None:
    """Admit sequences in the given order while tokens, slots and blocks last; stop at
    the first that does not fit (no overtaking, so the order is kept)."""
    for seq in candidates:
        if budget.tokens <= 0 or budget.seqs <= 0:
            return
        remaining = seq.num_uncomputed
        if not chunk and remaining > budget.tokens:
            return
        n = chunk_size(seq, budget, long_prefill)
        need = view.blocks_needed(seq, n)
        if need > budget.blocks:
            return
        out.tokens[seq] = n
        budget.tokens -= n
        budget.blocks -= need
        budget.seqs -= 1


def start_budget(view: SchedulerView) -> Budget:
    """This step's budget: the token limit, the free blocks, and the free sequence slots."""
    limits = view.limits
    return Budget(limits.max_num_batched_tokens, view.free_blocks(), limits.max_num_seqs - len(view.running))
