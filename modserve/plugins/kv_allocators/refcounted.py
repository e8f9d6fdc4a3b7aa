"""Blocks shared by reference count, copied before a shared one is written: what the paged
(hash-chain) and radix (tree) allocators have in common. They differ in what a block whose
last holder let go becomes (plain free, or cached until evicted): ``_take`` and ``_release``."""

from __future__ import annotations

from abc import abstractmethod
from collections import Counter
from typing import Iterable

from pydantic import BaseModel

from modserve.api import KVAllocator, Sequence


class RefCountedAllocator(KVAllocator):
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 options: BaseModel | None = None) -> None:
        super().__init__(num_blocks, block_size, max_model_len, options)
        self.ref_counts = [0] * num_blocks  # holders of each block (sequences' tables)
        self.copies: list[tuple[int, int]] = []  # (shared, own) copy-on-write, for take_copies
        self.published: dict[int, int] = {}  # seq_id -> leading blocks already offered to the prefix cache
        self.queried_tokens = 0  # prompt tokens match_prefix was asked about
        self.hit_tokens = 0  # of those, tokens it found cached
        self.evictions = 0  # cached blocks given to a new holder

    @abstractmethod
    def _take(self) -> int:
        """A block for a new holder (reference count 1), evicting a cached one if it must."""

    @abstractmethod
    def _release(self, block: int) -> None:
        """One holder fewer for ``block``."""

    @abstractmethod
    def num_cached_blocks(self) -> int:
        """Blocks the prefix cache holds (in use or not)."""

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return super().blocks_needed(seq, num_tokens) + int(self._needs_copy(seq, num_tokens))

    def blocks_freed_by(self, seq: Sequence) -> int:
        return sum(1 for b in seq.block_ids if self.ref_counts[b] == 1)

    def _needs_copy(self, seq: Sequence, num_tokens: int) -> bool:
        # The next write lands inside an existing block that someone else also holds.
        pos = seq.num_computed_tokens
        idx = pos // self.block_size
        return num_tokens > pos and pos % self.block_size != 0 and idx < len(seq.block_ids) \
            and self.ref_counts[seq.block_ids[idx]] > 1

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        if self.blocks_needed(seq, num_tokens) > self.num_free_blocks():
            return False
        if self._needs_copy(seq, num_tokens):
            idx = seq.num_computed_tokens // self.block_size
            shared = seq.block_ids[idx]
            own = self._take()
            self.copies.append((shared, own))
            self._release(shared)
            seq.block_ids[idx] = own
        for _ in range(-(-num_tokens // self.block_size) - len(seq.block_ids)):
            seq.block_ids.append(self._take())
        return True

    def free(self, seq: Sequence) -> None:
        # Tail first, so a sequence's last blocks (least likely shared) are evicted first.
        for block in reversed(seq.block_ids):
            self._release(block)
        seq.block_ids.clear()
        self.published.pop(seq.seq_id, None)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_ids) > keep:
            self._release(seq.block_ids.pop())

    def _newly_full(self, seq: Sequence) -> range:
        """Indices of ``seq``'s blocks that are full since the prefix cache was last offered
        them (``mark_computed``); recorded as offered now."""
        # NOTE: a speculating sequence's accepted drafts are computed before they are appended: a
        # block is offered once its tokens are known too (the next step offers the rest).
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        start = self.published.get(seq.seq_id, 0)
        if full > start:
            self.published[seq.seq_id] = full
        return range(start, full)

    def _share(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (no blocks yet) holds every block of ``parent``'s table too."""
        for block in parent.block_ids:
            self.ref_counts[block] += 1
        child.block_ids = list(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def check_reference_counts(self, holders: Iterable[Sequence]) -> None:
        """Each block's reference count is the number of ``holders``' tables that list it."""
        counts = Counter(b for seq in holders for b in seq.block_ids)
        wrong = [(b, self.ref_counts[b], counts[b]) for b in range(self.num_blocks) if self.ref_counts[b] != counts[b]]
        assert not wrong, "reference counts differ from the holders' tables: " + ", ".join(
            f"block {b} counts {refs}, {held} tables hold it" for b, refs, held in wrong[:5])

    def stats(self) -> dict[str, float]:
        return {
            **super().stats(),
            "cached_blocks": self.num_cached_blocks(),
            "prefix_queried_tokens": self.queried_tokens,
            "prefix_hit_tokens": self.hit_tokens,
            "evictions": self.evictions,
        }
