"""Paged KV allocation with automatic prefix caching and copy-on-write sharing."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable

from pydantic import BaseModel, ConfigDict

from modserve.api import AllBlocksCleared, BlockRemoved, BlockStored, Sequence, block_keys
from modserve.plugins.kv_allocators.refcounted import RefCountedAllocator


class PagedOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enable_prefix_caching: bool = True


class PagedAllocator(RefCountedAllocator):
    """Fixed-size blocks on demand, ref-counted, with full blocks cached by content.

    NOTE: a full block's key is its ``block_keys`` one, sha256(parent key + its token
    ids), so a key names the whole prefix up to that block and a match can never be a
    collision in practice. A freed block keeps its key and contents and waits in an LRU queue;
    it is evicted only when a block is needed and no plain free block is left.
    Partial blocks are never cached, so cached blocks are never written again.
    """

    reports_events = True
    keys_by_adapter = True  # block_keys salted by seq.cache_salt

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 options: PagedOptions | None = None) -> None:
        super().__init__(num_blocks, block_size, max_model_len, options)
        self.caching = (options or PagedOptions()).enable_prefix_caching
        self.block_key: list[str | None] = [None] * num_blocks
        self.cached: dict[str, int] = {}  # key -> block holding it
        self.free_plain: deque[int] = deque(range(num_blocks))  # no key: reuse first
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # keyed, least recently freed first

    # -- counting -------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    # -- allocate / free --------------------------------------------------------------
    def _take(self) -> int:
        if self.free_plain:
            block = self.free_plain.popleft()
        else:
            block, _ = self.free_cached.popitem(last=False)
            del self.cached[self.block_key[block]]
            self.record(BlockRemoved([self.block_key[block]]))
            self.block_key[block] = None
            self.evictions += 1
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.block_key[block] is None:
                self.free_plain.append(block)
            else:
                self.free_cached[block] = None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self._share(parent, child)
        self.published[child.seq_id] = self.published.get(parent.seq_id, 0)

    # -- prefix cache -------------------------------------------------------------------
    def _keys(self, seq: Sequence, num_blocks: int) -> list[str]:
        """The keys of ``seq``'s first ``num_blocks`` blocks, made into ``seq.block_hashes`` when
        missing. NOTE: the KV connector's planning extends that list too, maybe past them."""
        return block_keys(seq.token_ids, self.block_size, num_blocks, seq.block_hashes, seq.cache_salt)[:num_blocks]

    def match_prefix(self, seq: Sequence) -> int:
        if not self.caching:
            return 0
        assert not seq.block_ids, "match_prefix needs a sequence without blocks"
        # Leave at least the last token to compute: its logits give the next token.
        keys = self._keys(seq, (seq.num_tokens - 1) // self.block_size)
        for key in keys:
            block = self.cached.get(key)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free_cached[block]
            self.ref_counts[block] += 1
            seq.block_ids.append(block)
        hit = len(seq.block_ids) * self.block_size
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += hit
        self.published[seq.seq_id] = len(seq.block_ids)
        return hit

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        if not self.caching or seq.block_ids:
            return 0
        # NOTE: _keys only extends seq.block_hashes, a memo of the keys match_prefix computes too.
        keys = self._keys(seq, (seq.num_tokens - 1) // self.block_size)
        return next((i for i, key in enumerate(keys) if key not in self.cached), len(keys)) * self.block_size

    def mark_computed(self, seq: Sequence) -> None:
        if not self.caching:
            return
        blocks = self._newly_full(seq)
        if not blocks:
            return
        keys = self._keys(seq, blocks.stop)
        stored: list[int] = []  # indices of the blocks cached now
        for i in blocks:
            block, key = seq.block_ids[i], keys[i]
            if self.block_key[block] is None and key not in self.cached:
                self.block_key[block] = key
                self.cached[key] = block
                stored.append(i)
        if self.events is not None:
            self._record_stored(seq, keys, stored)

    def _record_stored(self, seq: Sequence, keys: list[str], stored: list[int]) -> None:
        """One BlockStored per run of consecutive indices, so each names its parent block."""
        bs, lora = self.block_size, getattr(seq, "lora_request", None)
        while stored:
            run = next((n for n in range(1, len(stored)) if stored[n] != stored[0] + n), len(stored))
            first, stop = stored[0], stored[0] + run
            self.record(BlockStored(keys[first:stop], keys[first - 1] if first else None,
                                    list(seq.token_ids[first * bs:stop * bs]),
                                    lora and lora.lora_int_id, lora and lora.lora_name))
            stored = stored[run:]

    def reset_prefix_cache(self) -> None:
        self.record(AllBlocksCleared())
        for block in self.cached.values():
            self.block_key[block] = None
        self.cached.clear()
        self.free_plain.extend(self.free_cached)
        self.free_cached.clear()

    def check_integrity(self, holders: Iterable[Sequence] | None = None) -> None:
        super().check_integrity(holders)
        n = self.num_blocks
        assert len(self.ref_counts) == len(self.block_key) == n, "per-block tables are not num_blocks long"
        plain, cached = set(self.free_plain), set(self.free_cached)
        assert len(plain) == len(self.free_plain), "a block is in the plain free list twice"
        assert not plain & cached, f"blocks {sorted(plain & cached)} are in both free lists"
        assert all(0 <= b < n for b in plain | cached), "a free list holds a block id out of range"
        for block, refs in enumerate(self.ref_counts):
            free = block in plain or block in cached
            assert refs >= 0, f"block {block} has reference count {refs}"
            assert (refs == 0) == free, (f"block {block} has reference count {refs} but is "
                                         f"{'' if free else 'not '}in a free list")
            key = self.block_key[block]
            assert block not in plain or key is None, f"plain free block {block} keeps a prefix key"
            assert block not in cached or key is not None, f"cached free block {block} has no prefix key"
            assert key is None or self.cached.get(key) == block, f"block {block}'s key maps elsewhere"
        assert all(self.block_key[b] == k for k, b in self.cached.items()), "the prefix cache names a stale block"
        assert self.num_free_blocks() == len(plain) + len(cached)
        if holders is not None:
            self.check_reference_counts(holders)

    def num_cached_blocks(self) -> int:
        return len(self.cached)
