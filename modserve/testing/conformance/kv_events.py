"""The KV cache events of an allocator with ``reports_events``, checked as a router reads them.

The workload's events are replayed into the multiset of cached keys a router would hold. Checked
after every operation: a ``BlockStored``'s keys are its parent's hash chain over its tokens, a
``BlockRemoved`` names only keys stored and not removed since, and no more than ``num_blocks``
copies are cached (an eviction never reported piles up past it); before every admission, the
blocks ``cached_prefix_tokens`` says are cached are all in the replayed set (a store never
reported, or a removal of a block still cached, shows up there).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter

from modserve.api import AllBlocksCleared, BlockRemoved, BlockStored, KVAllocator, Sequence, block_keys
from modserve.testing.conformance.kv_workload import KVWorkload


def chain(parent_key: str | None, token_ids: list[int], block_size: int) -> list[str]:
    """``block_keys`` continued from ``parent_key`` over ``token_ids``' full blocks."""
    parent, keys = b"" if parent_key is None else bytes.fromhex(parent_key), []
    for start in range(0, len(token_ids) - len(token_ids) % block_size, block_size):
        parent = hashlib.sha256(parent + array("q", token_ids[start:start + block_size]).tobytes()).digest()
        keys.append(parent.hex())
    return keys


class EventCheckedWorkload(KVWorkload):
    def __init__(self, allocator: KVAllocator, seed: int) -> None:
        super().__init__(allocator, seed)
        allocator.enable_events()
        self.cached: Counter[str] = Counter()  # key -> copies stored and not removed
        self.counts: Counter[str] = Counter()  # events seen, by kind

    def take(self, when: str) -> None:
        name = type(self.alloc).__name__
        for event in self.alloc.take_events():
            self.counts[type(event).__name__] += 1
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.keys) * self.bs, (
                    f"after {when}: {name} stored {len(event.keys)} blocks with {len(event.token_ids)} tokens")
                assert chain(event.parent_key, event.token_ids, self.bs) == event.keys, (
                    f"after {when}: a BlockStored's keys are not block_keys' chain from its parent_key over "
                    f"its token_ids")
                self.cached.update(event.keys)
            elif isinstance(event, BlockRemoved):
                unknown = [k for k in event.keys if self.cached[k] <= 0]
                assert not unknown, f"after {when}: {name} removed {len(unknown)} blocks it never stored"
                self.cached.subtract(event.keys)
            else:
                assert isinstance(event, AllBlocksCleared), f"after {when}: {name} recorded {event!r}"
                self.cached.clear()
        copies = sum(n for n in self.cached.values() if n > 0)
        assert copies <= self.alloc.num_blocks, (
            f"after {when}: by its events {name} caches {copies} blocks, more than num_blocks="
            f"{self.alloc.num_blocks}: a BlockRemoved was not recorded for an evicted block")

    def check(self, when: str) -> None:
        super().check(when)
        self.take(when)

    def admit(self, seq: Sequence) -> None:
        self.take("the operations before an admission")
        hit = self.alloc.cached_prefix_tokens(seq)
        keys = block_keys(seq.token_ids, self.bs, hit // self.bs)
        missing = [i for i, k in enumerate(keys) if self.cached[k] <= 0]
        assert not missing, (
            f"cached_prefix_tokens finds {hit} tokens of sequence {seq.seq_id} cached, but by its events "
            f"{type(self.alloc).__name__} does not hold its blocks {missing}: a BlockStored never recorded, "
            f"or a BlockRemoved for a block still cached")
        super().admit(seq)

    def cached_keys(self) -> set[str]:
        """What the events say is cached now."""
        return {k for k, n in self.cached.items() if n > 0}
