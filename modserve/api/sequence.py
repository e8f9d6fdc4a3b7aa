"""A sequence as plugins see it: what they may read, never write.

The core passes its own :class:`~modserve.core.sequence.Sequence` objects (no copy per
step); this Protocol is the part of them that is promised. Only the allocator that owns
a sequence's blocks writes ``block_ids``; ``block_hashes`` is only ever extended, by
:func:`~modserve.api.block_keys` (the allocator and the KV connector's planning share it).
"""

from __future__ import annotations

from typing import Protocol

from modserve.core.sampling_params import SamplingParams
from modserve.core.sequence import SequenceStatus


class SequenceView(Protocol):
    @property
    def seq_id(self) -> int: ...  # unique in the engine, never reused
    @property
    def request_id(self) -> str: ...  # the request's; its n samples share it
    @property
    def index(self) -> int: ...  # which of the request's n samples this is
    @property
    def params(self) -> SamplingParams: ...
    @property
    def priority(self) -> int: ...  # lower runs first under the ``priority`` policy
    @property
    def arrival_time(self) -> float: ...  # time.perf_counter() when the request arrived
    @property
    def token_ids(self) -> list[int]: ...  # prompt then output tokens
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...  # len(token_ids)
    @property
    def num_computed_tokens(self) -> int: ...  # tokens whose KV is in the cache
    @property
    def num_uncomputed(self) -> int: ...  # tokens a schedule may give it now (uncomputed + draft slots)
    @property
    def num_lookahead(self) -> int: ...  # draft slots of a speculating decode, beyond its tokens
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def block_ids(self) -> list[int]: ...  # its block table (the allocator's to change)
    @property
    def block_hashes(self) -> list[str]: ...  # block_keys of its first full blocks, as far as made yet
    @property
    def cache_salt(self) -> bytes: ...  # block_keys' salt: its LoRA adapter's, b"" for the base model
    @property
    def status(self) -> SequenceStatus: ...
    @property
    def is_finished(self) -> bool: ...
