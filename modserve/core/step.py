"""One engine step as data: what the scheduler hands the runner (:class:`ScheduledStep`) and
what comes back (:class:`ModelOutput`), as vLLM's ``SchedulerOutput`` and ``ModelRunnerOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from modserve.core.contracts.kv_connector import BlockTransfer
from modserve.core.contracts.sampler import SamplerOutput
from modserve.core.sequence import Sequence


@dataclass(slots=True)
class ScheduledStep:
    """One step as scheduled: what the runner computes, and the block moves before it."""

    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence; a speculating one's drafts included
    preempted: list[Sequence]
    copies: list[tuple[int, int]] = field(default_factory=list)  # device block -> device block
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # device block -> host block
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # host block -> device block
    # Speculative decoding: the drafts each speculating sequence computes after its last
    # real token (vLLM's scheduled_spec_decode_tokens), and [len(drafts), V] the
    # distributions they were drawn from (absent: drawn deterministically, q one-hot).
    draft_tokens: dict[Sequence, list[int]] = field(default_factory=dict)
    draft_probs: dict[Sequence, torch.Tensor] = field(default_factory=dict)
    # A KV connector's work: blocks of newly admitted sequences to load before the forward,
    # and full prompt blocks complete by the end of the step to save as they are written.
    kv_loads: dict[Sequence, list[BlockTransfer]] = field(default_factory=dict)
    kv_saves: dict[Sequence, list[BlockTransfer]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass(slots=True)
class ModelOutput:
    """What one executed step produced, the same for every sequence that got tokens."""

    # Per sequence: its sampled token, or its accepted drafts and one token more. The
    # samples (n > 1) forked this step follow their parent; the order is the rows' order.
    token_ids: dict[Sequence, list[int]] = field(default_factory=dict)
    # One row per token above, in that order: the logprob, rank and top logprobs of the row
    # it was drawn from. None when no sequence asked for logprobs.
    samples: SamplerOutput | None = None
    # Prompt logprobs (ModelInput.prompt_seqs) and their rows, on the CPU: token_ids are the
    # prompt tokens predicted, their logprobs, ranks and the top N of every row.
    prompt_seqs: dict[Sequence, tuple[int, int, int]] = field(default_factory=dict)
    prompt_samples: SamplerOutput | None = None
