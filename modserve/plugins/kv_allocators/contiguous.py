"""The pre-paging baseline: every sequence reserves max_model_len tokens up front."""

from __future__ import annotations

from collections import deque

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
