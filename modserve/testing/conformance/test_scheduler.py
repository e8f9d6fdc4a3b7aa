"""Scheduler: every schedule is one the core accepts, and every sequence finishes.

The policy runs against :class:`.scheduler_sim.FakeSchedulerView`, not an engine: twelve
sequences arriving over the first steps, under a tight capacity (one long sequence fills the
blocks: preemption) and a loose one, with recompute and swap preemption.
"""

from __future__ import annotations

import pytest

from modserve.api import SchedulerLimits
from modserve.testing.conformance.scheduler_sim import LOOSE, TIGHT, Capacity, SchedulerSim
from modserve.testing.conformance.targets import Implementation

CONFORMANCE_KIND = "scheduler"


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("capacity", [TIGHT, LOOSE], ids=lambda c: c.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_valid_schedules_until_every_sequence_finishes(implementation: Implementation, capacity: Capacity,
                                                       preemption: str, seed: int) -> None:
    """Each step: ``schedule`` only reads the view and returns a ``Schedule`` within
    max_num_seqs and max_num_batched_tokens, whose new blocks fit what is free after its
    preemptions, preempting only running sequences and giving each scheduled one 1 to
    ``num_uncomputed`` tokens. Over the run: every sequence finishes (no starvation), and no
    step with work left schedules nothing (no livelock)."""
    limits = SchedulerLimits(capacity.max_num_seqs, capacity.max_num_batched_tokens, capacity.max_model_len)
    sim = SchedulerSim(implementation.create(limits), capacity, preemption, seed)
    sim.run()
