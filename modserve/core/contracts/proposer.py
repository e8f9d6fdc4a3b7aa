"""The proposer's contract (config key ``speculative_config``): draft tokens for speculative
decoding.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch
from pydantic import BaseModel

from modserve.core.contracts.sampler import Sampler
from modserve.core.sequence import Sequence


@dataclass(slots=True)
class ProposerContext:
    """What a proposer may need to build itself: the engine's settings and resources."""

    config: Any  # EngineConfig
    registry: Any  # Registry, to load a draft model's architecture and attention backend
    device: torch.device
    dtype: torch.dtype
    num_blocks: int  # a proposer with its own KV cache shares the target's block tables
    block_size: int
    max_model_len: int
    vocab_size: int
    sampler: "Sampler"  # to turn draft logits into the request's processed distribution
    # A second checkpoint (a draft sharing the target's tokenizer) ready to run beside the
    # target: a :class:`~modserve.runner.model_runner.ModelRunner` on the engine's device and
    # dtype, with KV tensors of its own for ``num_blocks`` blocks, indexed by the target's block
    # tables, so it needs no allocator. Run it with ``last_token_logits(seqs, chunks,
    # context_lens)``; ``sampling_batch(seqs)`` gives the requests' settings for ``sampler``. Its
    # own checkpoint decides its quantization (a float draft of an AWQ target stays float). A
    # checkpoint of another vocabulary size is a ``ValueError``, raised before any weight loads.
    load_model: Callable[[str], Any]


@dataclass(slots=True)
class Proposal:
    token_ids: list[list[int]]  # per sequence, at most k draft tokens continuing seq.token_ids
    # [B, K, V] the distributions the drafts were drawn from (rows past a sequence's
    # drafts are ignored); None when proposals are deterministic (q is one-hot).
    probs: torch.Tensor | None = None


class Proposer(ABC):
    """Proposes draft tokens for speculative decoding.

    Contract: ``propose(seqs, num_tokens)`` is called once per step for sequences about
    to decode, after each one's KV blocks for ``1 + num_tokens[i]`` new tokens were
    allocated; it returns at most ``num_tokens[i]`` tokens for sequence ``i`` (fewer, or
    none, is fine). A proposer with a KV cache of its own writes it only at slots of
    those blocks. ``forget(seq)`` is
    called when a sequence finishes, is aborted or preempted.
    """

    def __init__(self, context: ProposerContext, options: BaseModel | None = None) -> None:
        self.context = context
        self.options = options

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal: ...

    def forget(self, seq: Sequence) -> None:
        """Drop any per-sequence state."""
