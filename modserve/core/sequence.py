"""The state of one sequence as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from modserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:  # the seams' types; none of them is needed at run time here
    import torch

    from modserve.core.contracts.grammar_backend import GrammarMatcher
    from modserve.core.lora_request import LoRARequest


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV copied to host memory
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One sequence: its tokens, how many have KV in the cache, and its blocks.

    NOTE: ``num_computed_tokens`` is the only progress counter. A step computes
    ``token_ids[num_computed_tokens : num_computed_tokens + n]``; prefill, chunked
    prefill, decode and recompute after preemption are all that one rule.
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float
    index: int = 0  # which of the request's n samples this is
    priority: int = 0  # lower runs first under the priority scheduler
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Content keys of the sequence's full blocks (contracts.kv_allocator.block_keys), made as
    # first needed by a prefix-cache allocator or the KV connector's planning, both extending
    # this one list; kept across preemption (the tokens don't change).
    block_hashes: list[str] = field(default_factory=list)
    # Samples of the same request (n > 1) that fork from this one once its prompt is computed.
    pending_forks: list["Sequence"] = field(default_factory=list)
    # Speculative decoding: draft slots the scheduler may grant beyond the real tokens
    # (set before each schedule; the drafts themselves travel in ScheduledStep.draft_tokens).
    num_lookahead: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prompt tokens the prefix cache held when first admitted (-1: not yet)
    # A KV connector's: how many of the prompt's full blocks the store holds (saves go on from
    # there), and whether a load of them failed.
    kv_stored_blocks: int = 0
    kv_load_failed: bool = False
    generator: "torch.Generator | None" = None  # seeded requests draw from their own
    grammar: "GrammarMatcher | None" = None  # a structured-outputs request's, once its grammar compiled
    lora_request: "LoRARequest | None" = None  # the adapter it runs under (enable_lora); None: the base model

    @property
    def cache_salt(self) -> bytes:
        """What its prefix-cache keys start from (block_keys' salt): its adapter's, so two adapters never share KV."""
        return b"" if self.lora_request is None else self.lora_request.cache_salt

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens a schedule may give this sequence now: its uncomputed ones plus lookahead."""
        return len(self.token_ids) + self.num_lookahead - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
