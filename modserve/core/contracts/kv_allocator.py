"""The KV allocator's contract (config key ``kv_allocator``): who owns which KV block, and
which full prompt blocks a new sequence can reuse.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from array import array
from collections import abc
from dataclasses import dataclass
from typing import Iterable, Union

from pydantic import BaseModel

from modserve.core.sequence import Sequence


def block_keys(token_ids: abc.Sequence[int], block_size: int, num_blocks: int | None = None,
               chain: list[str] | None = None, salt: bytes = b"") -> list[str]:
    """The content keys of the first ``num_blocks`` full blocks of ``token_ids`` (default: all):
    block i's is the hex sha256 of block i-1's digest and its tokens as int64s, so equal keys
    mean equal tokens from the first to the block's end, in every process and run. The prefix
    cache, the KV connector's store and the data-parallel router all name blocks by it.

    ``salt``: what the first key hashes with its tokens (``seq.cache_salt``: adapters' KV apart).
    ``chain``: the keys already made for these tokens (``seq.block_hashes``), extended in place
    and returned. NOTE: another caller may have made it longer than ``num_blocks``: read only
    the first ``num_blocks``."""
    keys = [] if chain is None else chain
    full = len(token_ids) // block_size
    stop = full if num_blocks is None else min(num_blocks, full)
    parent = bytes.fromhex(keys[-1]) if keys else salt  # a LoRA adapter's (Sequence.cache_salt): its own chain
    for start in range(len(keys) * block_size, stop * block_size, block_size):
        parent = hashlib.sha256(parent + array("q", token_ids[start:start + block_size]).tobytes()).digest()
        keys.append(parent.hex())
    return keys


# KV cache events (``kv_events_config``): what a router needs to know which engine holds which prefix.
@dataclass(slots=True)
class BlockStored:
    """Full blocks became reusable by later requests (prefix cache), in chain order: ``keys`` are
    their ``block_keys``, ``parent_key`` the key of the block before the first (None: it starts
    the prompt), ``token_ids`` their tokens (``len(keys) * block_size``); ``lora_id`` and
    ``lora_name``: the adapter whose KV they hold (``seq.lora_request``), None for the base model."""

    keys: list[str]
    parent_key: str | None
    token_ids: list[int]
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks were evicted: no later request can reuse them."""

    keys: list[str]


@dataclass(slots=True)
class AllBlocksCleared:
    """``reset_prefix_cache``: every cached block is forgotten."""


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVAllocator(ABC):
    """Hands out the KV cache's blocks to sequences.

    Contract: block ids are ints in ``[0, num_blocks)``; ``seq.block_ids`` is the
    sequence's block table, owned by the allocator (callers only read it).
    ``allocate`` is all-or-nothing. After ``free`` of every live sequence,
    ``num_free_blocks() == num_blocks`` (blocks kept only as prefix cache count as
    free: they are evicted on demand). Allocate and free are O(1) per block.
    A block shared by several sequences is never written in place: ``allocate``
    copies it first (copy-on-write) and reports the copy through ``take_copies``.
    """

    #: True when the allocator reports its prefix cache's changes (``enable_events``).
    reports_events = False
    #: True when its prefix cache keys blocks by ``seq.cache_salt`` (``block_keys``' salt), so LoRA
    #: adapters never share KV; the engine refuses enable_lora with a caching allocator that does not.
    keys_by_adapter = False

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 options: BaseModel | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.options = options
        self.events: list[KVCacheEvent] | None = None  # recording when a list (enable_events)

    def enable_events(self) -> None:
        """Record KV cache events from now on (the engine calls it once, before any request, when
        ``kv_events_config`` enables them). An allocator with ``reports_events`` then calls
        ``record``: ``BlockStored`` when full blocks enter its prefix cache, ``BlockRemoved`` when it
        evicts them, ``AllBlocksCleared`` on ``reset_prefix_cache``; so the stream alone rebuilds
        the set of cached block keys. NOTE: a key stored twice (two copies) is removed twice."""
        self.events = []

    def record(self, event: KVCacheEvent) -> None:
        """Keep ``event`` for ``take_events`` if recording; else nothing (no cost when off)."""
        if self.events is not None:
            self.events.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first (the engine takes them after
        each step and publishes them)."""
        events, self.events = self.events, ([] if self.events is not None else None)
        return events or []

    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` could hand out now."""

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``allocate(seq, num_tokens)`` would take."""
        needed = -(-num_tokens // self.block_size)
        return max(0, needed - len(seq.block_ids))

    def blocks_freed_by(self, seq: Sequence) -> int:
        """Blocks that ``free(seq)`` would return (shared blocks stay with their other holders)."""
        return len(seq.block_ids)

    @abstractmethod
    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Make ``seq.block_ids`` cover ``num_tokens`` tokens, ready for writes from
        ``seq.num_computed_tokens`` on. False (and no change) if short of blocks."""

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` and empty its table."""

    def match_prefix(self, seq: Sequence) -> int:
        """For a sequence with no blocks: attach cached blocks holding a prefix of its
        tokens and return how many tokens they cover (always fewer than
        ``seq.num_tokens``: the last token is computed to get logits).
        Allocators without a prefix cache return 0."""
        return 0

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """How many tokens ``match_prefix(seq)`` would attach now; changes nothing (a
        scheduling policy may ask it of waiting sequences). Default: 0."""
        return 0

    def mark_computed(self, seq: Sequence) -> None:
        """Called after a step wrote KV up to ``seq.num_computed_tokens``, so full
        blocks can be published to a prefix cache. Default: nothing."""

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release blocks past the first ``num_tokens`` tokens (rejected speculative
        slots). Default: keep them; the sequence reuses them as it grows."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Make ``child`` (no blocks yet) share all of ``parent``'s blocks."""
        raise NotImplementedError(f"{type(self).__name__} does not support fork")

    def take_copies(self) -> list[tuple[int, int]]:
        """(source, destination) block copies that must happen before the next forward."""
        return []

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay in use): later requests compute
        their prompts in full. Default: nothing is cached, nothing to do."""

    def stats(self) -> dict[str, float]:
        """Counters for engine stats and /metrics."""
        return {"num_blocks": self.num_blocks, "free_blocks": self.num_free_blocks()}

    def check_integrity(self, holders: Iterable[Sequence] | None = None) -> None:
        """Raise ``AssertionError`` (or ``ValueError``) describing the first inconsistency in the
        allocator's bookkeeping: a block both free and held, a block neither free nor held, a
        block id outside ``[0, num_blocks)``, a free count that differs from ``num_free_blocks()``.
        With ``holders`` (every sequence holding blocks), also reference counts that do not match
        the holders' block tables. Changes nothing; only tests call it (the conformance kit, after
        every operation), so it need not be fast. Default: what the base class can see, the
        free count's range and the holders' block ids."""
        free = self.num_free_blocks()
        if not 0 <= free <= self.num_blocks:
            raise AssertionError(f"num_free_blocks() = {free}, outside [0, num_blocks={self.num_blocks}]")
        held: set[int] = set()
        for seq in holders or ():
            bad = [b for b in seq.block_ids if not (isinstance(b, int) and 0 <= b < self.num_blocks)]
            if bad:
                raise AssertionError(f"sequence {seq.seq_id} holds block ids {bad}, outside [0, {self.num_blocks})")
            if len(set(seq.block_ids)) != len(seq.block_ids):
                raise AssertionError(f"sequence {seq.seq_id} lists a block twice: {seq.block_ids}")
            held.update(seq.block_ids)
        if len(held) + free > self.num_blocks:
            raise AssertionError(f"{len(held)} blocks are held and num_free_blocks() = {free}: more than "
                                 f"num_blocks={self.num_blocks}, so a held block counts as free")
