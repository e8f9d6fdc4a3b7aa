"""The pre-paging baseline: every sequence reserves max_model_len tokens up front."""

from __future__ import annotations

from collections import deque
from typing import Iterable

from pydantic import BaseModel

from modserve.api import KVAllocator, Sequence


class ContiguousAllocator(KVAllocator):
    """The pool is cut into slabs of ``ceil(max_model_len / block_size)`` consecutive
    blocks; an admitted sequence takes a whole slab, however short it turns out.
    Kept so A/B runs show what paging buys (concurrency, KV utilisation)."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 options: BaseModel | None = None) -> None:
        self.slab = -(-max_model_len // block_size)
        num_slabs = num_blocks // self.slab
        if num_slabs == 0:
            raise ValueError(f"{num_blocks} KV blocks hold no slab of {self.slab} blocks (max_model_len)")
        super().__init__(num_slabs * self.slab, block_size, max_model_len, options)
        self.free_slabs: deque[int] = deque(range(num_slabs))

    def num_free_blocks(self) -> int:
        return len(self.free_slabs) * self.slab

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return 0 if seq.block_ids else self.slab

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        if seq.block_ids:
            return num_tokens <= self.slab * self.block_size
        if not self.free_slabs:
            return False
        first = self.free_slabs.popleft() * self.slab
        seq.block_ids.extend(range(first, first + self.slab))
        return True

    def free(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.free_slabs.append(seq.block_ids[0] // self.slab)
            seq.block_ids.clear()

    def check_integrity(self, holders: Iterable[Sequence] | None = None) -> None:
        super().check_integrity(holders)
        num_slabs = self.num_blocks // self.slab
        free = set(self.free_slabs)
        assert len(free) == len(self.free_slabs), "a slab is in the free list twice"
        assert all(0 <= s < num_slabs for s in free), f"a free slab id is outside [0, {num_slabs})"
        if holders is None:
            return
        held: dict[int, int] = {}  # slab -> the sequence holding it
        for seq in holders:
            if not seq.block_ids:
                continue
            first = seq.block_ids[0]
            slab = first // self.slab
            assert seq.block_ids == list(range(first, first + self.slab)) and first % self.slab == 0, (
                f"sequence {seq.seq_id}'s blocks {seq.block_ids} are not one whole slab")
            assert slab not in free, f"slab {slab} is free and held by sequence {seq.seq_id}"
            assert slab not in held, f"slab {slab} is held by sequences {held[slab]} and {seq.seq_id}"
            held[slab] = seq.seq_id
        assert len(held) + len(free) == num_slabs, (
            f"{num_slabs - len(held) - len(free)} slabs are neither free nor held")
