"""Paged KV allocation: fixed-size blocks taken on demand from a free list."""

from __future__ import annotations

from collections import deque

from pydantic import BaseModel

from modserve.core.interfaces import KVAllocator
from modserve.core.sequence import Sequence


class PagedAllocator(KVAllocator):
    """Blocks handed out from a deque, O(1) each way.

    NOTE: every block carries a reference count so that sequences can share
    blocks (forked samples, cached prefixes); a block returns to the free list
    only when its last holder lets go.
    """

    def __init__(self, num_blocks: int, block_size: int, options: BaseModel | None = None) -> None:
        super().__init__(num_blocks, block_size, options)
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self.free_ids):
            return False
        for _ in range(needed):
            block = self.free_ids.popleft()
            self.ref_counts[block] = 1
            seq.block_ids.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        # Reversed so a sequence's tail blocks are reused last (they are the least likely to be shared).
        for block in reversed(seq.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_ids.append(block)
        seq.block_ids.clear()
