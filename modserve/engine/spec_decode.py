"""Speculative decoding in the step: draft slots before scheduling, drafts into the
scheduled step, verification after the target's forward pass.

A speculating sequence goes through one step as:

1. ``SpecDecode.reserve``: a running decode gets up to ``k`` lookahead slots
   (``seq.num_lookahead``); the policy schedules them like any other token, so they
   count against the token budget and the KV blocks.
2. ``SpecDecode.propose``: the proposer fills the granted slots; the drafts (cut to what
   the request's grammar accepts) travel in ``ScheduledStep.draft_tokens``, and the
   sequence's scheduled tokens shrink to ``1 + len(drafts)``.
3. The runner computes the last real token and the drafts in one pass and calls
   ``verify_drafts``: rejection sampling against the target (:mod:`modserve.runner.rejection`).
4. ``SchedulerCore.update`` keeps the KV of the accepted drafts only.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Iterable


from modserve.core.contracts.proposer import Proposer, ProposerContext
from modserve.core.plugin_calls import calling, checked_proposal
from modserve.core.sequence import Sequence
from modserve.runner.model_runner import load_draft

if TYPE_CHECKING:
    from modserve.core.config import EngineConfig
    from modserve.core.step import ModelOutput
    from modserve.runner.model_runner import ModelRunner
    from modserve.core.registry import Registry
    from modserve.core.step import ScheduledStep


class SpecDecode:
    """The engine's side of speculative decoding. Without a proposer every method does nothing."""

    def __init__(self, proposer: Proposer | None, num_speculative_tokens: int, max_model_len: int,
                 vocab_size: int) -> None:
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.counters = {"spec_proposed_tokens": 0, "spec_accepted_tokens": 0, "spec_verifications": 0}

    @classmethod
    def create(cls, config: EngineConfig, registry: Registry, runner: ModelRunner, num_blocks: int,
               max_model_len: int) -> SpecDecode:
        """With the proposer ``config.speculative`` names, built beside the target ``runner``."""
        spec = config.speculative
        if spec is None:
            return cls(None, 0, max_model_len, runner.vocab_size)
        draft = functools.partial(load_draft, config=config, registry=registry, dtype=runner.dtype,
                                  num_blocks=num_blocks, max_model_len=max_model_len, vocab_size=runner.vocab_size)
        context = ProposerContext(config, registry, runner.device, runner.dtype, num_blocks, config.block_size,
                                  max_model_len, runner.vocab_size, runner.sampler, draft)
        return cls(registry.create("proposer", spec.proposer, context), spec.num_speculative_tokens, max_model_len,
                   runner.vocab_size)

    def reserve(self, running: Iterable[Sequence], max_tokens: Callable[[Sequence], int]) -> dict[Sequence, int]:
        """Each running sequence's draft slots for the next schedule (the scheduler grants them);
        ``max_tokens(seq)`` is its request's limit on output tokens."""
        if self.proposer is None:
            return {}
        return {seq: self._lookahead(seq, max_tokens(seq)) for seq in running}

    def _lookahead(self, seq: Sequence, max_tokens: int) -> int:
        """Draft slots a running sequence may speculate into this step (0: it won't)."""
        p = seq.params
        if (seq.num_computed_tokens != seq.num_tokens - 1 or seq.pending_forks
                or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.bad_words
                or seq.num_output_tokens < p.min_tokens):
            # NOTE: penalties, bad_words and min_tokens depend on the tokens before each draft
            # position; such requests decode one token at a time rather than approximately.
            return 0
        room = min(max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(self.k, room))

    def propose(self, scheduled: ScheduledStep) -> None:
        """Fill the draft slots the schedule granted, shrink them to what was proposed, and
        put the drafts into ``scheduled``; preempted sequences lose their slots."""
        if self.proposer is None:
            return
        for seq in scheduled.preempted:
            self.forget(seq)
        granted = [(i, s, n - 1) for i, (s, n) in enumerate(zip(scheduled.seqs, scheduled.num_new_tokens))
                   if n > s.num_tokens - s.num_computed_tokens]
        if granted:
            self._fill(scheduled, granted)

    def _fill(self, scheduled: ScheduledStep, granted: list[tuple[int, Sequence, int]]) -> None:
        ks = [k for _, _, k in granted]
        with calling(self.proposer, "proposer", "propose()"):
            proposal = self.proposer.propose([s for _, s, _ in granted], ks)
        checked_proposal(self.proposer, proposal, ks, self.vocab_size)
        for j, (i, seq, k) in enumerate(granted):
            drafts = list(proposal.token_ids[j])
            if seq.grammar is not None:
                drafts = _grammar_prefix(seq.grammar, drafts)
            scheduled.num_new_tokens[i] = 1 + len(drafts)
            self.counters["spec_proposed_tokens"] += len(drafts)
            if drafts:
                scheduled.draft_tokens[seq] = drafts
                if proposal.probs is not None:
                    scheduled.draft_probs[seq] = proposal.probs[j, : len(drafts)]  # [len(drafts), V]

    def count(self, scheduled: ScheduledStep, output: ModelOutput) -> None:
        """Add one executed step's verifications to the counters."""
        for seq in scheduled.draft_tokens:
            self.counters["spec_verifications"] += 1
            self.counters["spec_accepted_tokens"] += len(output.token_ids[seq]) - 1

    def forget(self, seq: Sequence) -> None:
        """A sequence finished, was aborted or lost its KV: no proposer state."""
        if self.proposer is not None:
            self.proposer.forget(seq)


def _grammar_prefix(matcher: Any, drafts: list[int]) -> list[int]:
    """The longest prefix of ``drafts`` the grammar accepts; the matcher ends as it began."""
    accepted = 0
    for token in drafts:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        accepted += 1
    matcher.rollback(accepted)
    return drafts[:accepted]




