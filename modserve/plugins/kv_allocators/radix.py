"""Paged KV allocation with a radix-tree prefix cache (SGLang's RadixCache, block-granular)."""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Iterable

from pydantic import BaseModel, ConfigDict

from modserve.api import AllBlocksCleared, BlockRemoved, BlockStored, Sequence, block_keys
from modserve.plugins.kv_allocators.refcounted import RefCountedAllocator


class RadixOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enable_prefix_caching: bool = True


@dataclass(eq=False, slots=True)
class RadixNode:
    """An edge of whole blocks: ``tokens`` (len = len(blocks) * block_size) held by ``blocks``."""

    parent: RadixNode | None
    tokens: tuple[int, ...]
    blocks: list[int]
    end: int  # blocks from the root to the end of this edge
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0  # live sequences whose path passes through here: never evicted while > 0
    last_access: int = 0
    alive: bool = True


class RadixAllocator(RefCountedAllocator):
    """Fixed-size blocks on demand, ref-counted, with full blocks cached in a radix tree.

    NOTE: invariants. A sequence's *path* is the deepest tree node whose blocks, root to
    there, are the first entries of its block table; it locks every node on it. So a tree
    block is held iff its node is locked, and an unlocked node (all its subtree unlocked
    too) is evictable: those blocks count as free. A block whose content is already in the
    tree under another block id (two sequences computed the same prefix in one step) is
    swapped for the tree's block and freed, as SGLang does, so the sequence's path goes on
    and its later blocks are published below it.
    Eviction takes one block at a time from the tail of the least recently used unlocked
    leaf (a heap keyed by last access, lazily invalidated), so a prefix outlives its
    extensions and no more is evicted than asked for.
    One tree per LoRA adapter (``seq.cache_salt``; ``root`` is the base model's): two adapters'
    KV differs for the same tokens, so a sequence matches and publishes in its adapter's tree
    only. A root is a node without parent; an adapter's empty tree is dropped.
    """

    reports_events = True
    keys_by_adapter = True

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 options: RadixOptions | None = None) -> None:
        super().__init__(num_blocks, block_size, max_model_len, options)
        self.caching = (options or RadixOptions()).enable_prefix_caching
        self.free_plain: deque[int] = deque(range(num_blocks))  # not in the tree: reuse first
        self.root = RadixNode(None, (), [], 0)  # the base model's tree
        self.roots: dict[bytes, RadixNode] = {b"": self.root}  # seq.cache_salt -> its tree
        self.block_node: dict[int, RadixNode] = {}  # tree block -> its node
        self.evictable = 0  # tree blocks in unlocked nodes
        self.heap: list[tuple[int, int, RadixNode]] = []  # (last access, tiebreak, leaf)
        self.tiebreak = itertools.count()
        self.clock = itertools.count(1)
        self.paths: dict[int, RadixNode] = {}  # seq_id -> its path's deepest node
        self.block_key: dict[int, str] = {}  # tree block -> its block_keys key, kept only for events

    # -- counting -------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + self.evictable

    # -- allocate / free --------------------------------------------------------------
    def _take(self) -> int:
        if not self.free_plain:
            self._evict_one()
        block = self.free_plain.popleft()
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0 and block not in self.block_node:
            self.free_plain.append(block)

    def free(self, seq: Sequence) -> None:
        self._set_path(seq.seq_id, None)
        super().free(seq)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        keep = -(-num_tokens // self.block_size)
        path = self.paths.get(seq.seq_id)
        if path is not None and path.end > keep:  # the path must stay within the table
            self._set_path(seq.seq_id, self._node_ending_at(path, keep))
            self.published[seq.seq_id] = min(self.published.get(seq.seq_id, 0), keep)
        super().trim(seq, num_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self._share(parent, child)
        self._set_path(child.seq_id, self.paths.get(parent.seq_id))
        self.published[child.seq_id] = self.published.get(parent.seq_id, 0)

    # -- the tree -----------------------------------------------------------------------
    def _key(self, tokens: list[int] | tuple[int, ...], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.block_size:(i + 1) * self.block_size])

    def _tree(self, seq: Sequence) -> RadixNode:
        """The root of ``seq``'s adapter's tree (made empty if it has none)."""
        return self.roots.setdefault(seq.cache_salt, RadixNode(None, (), [], 0))

    def _drop_if_empty(self, root: RadixNode) -> None:
        if root is not self.root and not root.children:
            self.roots = {salt: r for salt, r in self.roots.items() if r is not root}

    def _lock(self, node: RadixNode | None, delta: int) -> None:
        while node is not None and node.parent is not None:
            if delta > 0 and node.lock_ref == 0:
                self.evictable -= len(node.blocks)
            node.lock_ref += delta
            if node.lock_ref == 0:
                self.evictable += len(node.blocks)
                if not node.children:
                    self._push(node)
            node = node.parent

    def _set_path(self, seq_id: int, node: RadixNode | None) -> None:
        # Lock the new path before unlocking the old: the nodes they share never look evictable.
        old = self.paths.pop(seq_id, None)
        if node is not None and node.parent is not None:
            self._lock(node, +1)
            self.paths[seq_id] = node
        self._lock(old, -1)

    def _push(self, leaf: RadixNode) -> None:
        heapq.heappush(self.heap, (leaf.last_access, next(self.tiebreak), leaf))
        # NOTE: stale entries leave only when eviction reaches them; without eviction pressure
        # they would pile up, one per free. Dropping them all when they outnumber the tree's
        # blocks keeps the heap O(tree) at amortised O(1) per push.
        if len(self.heap) > 2 * len(self.block_node) + 64:
            self.heap = [e for e in self.heap if self._evictable_leaf(e)]
            heapq.heapify(self.heap)

    @staticmethod
    def _evictable_leaf(entry: tuple[int, int, RadixNode]) -> bool:
        stamp, _, leaf = entry
        return leaf.alive and not leaf.children and leaf.lock_ref == 0 and stamp == leaf.last_access

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node``'s edge after its first ``k`` blocks; return the new upper node.
        NOTE: ``node`` stays the lower half, so paths ending at it stay right."""
        bs = self.block_size
        upper = RadixNode(node.parent, node.tokens[:k * bs], node.blocks[:k], node.end - len(node.blocks) + k,
                          lock_ref=node.lock_ref, last_access=node.last_access)
        node.parent.children[upper.tokens[:bs]] = upper
        node.tokens, node.blocks, node.parent = node.tokens[k * bs:], node.blocks[k:], upper
        upper.children[node.tokens[:bs]] = node
        for b in upper.blocks:
            self.block_node[b] = upper
        return upper

    def _node_ending_at(self, node: RadixNode, depth: int) -> RadixNode:
        """The node on ``node``'s path to the root whose edge ends ``depth`` blocks down (split if needed)."""
        while node.parent is not None and node.end - len(node.blocks) >= depth:
            node = node.parent
        if node.end > depth:
            node = self._split(node, depth - (node.end - len(node.blocks)))
        return node

    def _edge_match(self, seq: Sequence, child: RadixNode, i: int, limit: int, own: bool) -> int:
        """Leading blocks of ``child``'s edge equal to ``seq``'s blocks from ``i`` on (before ``limit``)."""
        m = 0
        while m < len(child.blocks) and i + m < limit and self._key(child.tokens, m) == self._key(seq.token_ids, i + m) \
                and (not own or child.blocks[m] == seq.block_ids[i + m]):
            m += 1
        return m

    def _follow(self, seq: Sequence, node: RadixNode, i: int, limit: int, own: bool) -> tuple[RadixNode, int]:
        """Walk down from ``node`` (``i`` blocks deep) over whole blocks of ``seq``'s tokens, at
        most to block ``limit``; ``own``: only over blocks that are ``seq``'s own block ids.
        Splits the last edge where the walk stops inside it; returns the node reached and its depth."""
        tokens = seq.token_ids
        while i < limit:
            child = node.children.get(self._key(tokens, i))
            if child is None:
                break
            m = self._edge_match(seq, child, i, limit, own)
            if m == 0:
                break
            node = child if m == len(child.blocks) else self._split(child, m)
            i += m
            if node is not child:  # stopped inside the edge
                break
        return node, i

    def _touch(self, node: RadixNode) -> None:
        now = next(self.clock)
        while node is not None and node.parent is not None:
            node.last_access = now
            node = node.parent

    def _evict_one(self) -> None:
        """Move one block from the tail of the least recently used unlocked leaf to the plain free list."""
        while not self._evictable_leaf(self.heap[0]):
            heapq.heappop(self.heap)  # stale: touched, locked, grown or gone since it was pushed
        leaf = self.heap[0][2]
        key = leaf.tokens[:self.block_size]
        block = leaf.blocks.pop()
        leaf.tokens = leaf.tokens[:-self.block_size]
        leaf.end -= 1
        del self.block_node[block]
        if self.events is not None:
            self.record(BlockRemoved([self.block_key.pop(block)]))
        self.evictable -= 1
        self.evictions += 1
        self.free_plain.append(block)
        if not leaf.blocks:
            heapq.heappop(self.heap)
            leaf.alive = False
            parent = leaf.parent
            del parent.children[key]
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                self._push(parent)
            elif parent.parent is None:
                self._drop_if_empty(parent)

    # -- prefix cache -------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        if not self.caching:
            return 0
        assert not seq.block_ids, "match_prefix needs a sequence without blocks"
        # Leave at least the last token to compute: its logits give the next token.
        root = self.roots.get(seq.cache_salt) or RadixNode(None, (), [], 0)  # no tree yet: nothing to match
        node, depth = self._follow(seq, root, 0, (seq.num_tokens - 1) // self.block_size, own=False)
        path: list[int] = []
        walk = node
        while walk.parent is not None:
            path[:0] = walk.blocks
            walk = walk.parent
        for block in path:
            self.ref_counts[block] += 1
        seq.block_ids.extend(path)
        self._set_path(seq.seq_id, node)
        self._touch(node)
        hit = depth * self.block_size
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += hit
        self.published[seq.seq_id] = depth
        return hit

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        if not self.caching or seq.block_ids:
            return 0
        node = self.roots.get(seq.cache_salt)  # None: no tree for its adapter yet
        limit, i = (seq.num_tokens - 1) // self.block_size, 0
        while node is not None and i < limit \
                and (child := node.children.get(self._key(seq.token_ids, i))) is not None:
            m = self._edge_match(seq, child, i, limit, own=False)
            node, i = child, i + m
            if m < len(child.blocks):
                break
        return i * self.block_size

    def mark_computed(self, seq: Sequence) -> None:
        if not self.caching:
            return
        blocks = self._newly_full(seq)
        if not blocks:
            return
        start, full = blocks.start, blocks.stop
        node = self.paths.get(seq.seq_id) or self._tree(seq)
        if node.end != start:  # stopped publishing earlier: its blocks hang off a prefix held elsewhere
            if node.parent is None:
                self._drop_if_empty(node)
            return
        node, i = self._follow(seq, node, start, full, own=True)
        while i < full:  # blocks the tree holds under other ids: adopt those, free the copies
            node, adopted = self._adopt(seq, node, i, full)
            if not adopted:
                break
            node, i = self._follow(seq, node, i + adopted, full, own=True)
        if i < full and self._key(seq.token_ids, i) not in node.children \
                and all(b not in self.block_node for b in seq.block_ids[i:full]):
            bs = self.block_size
            child = RadixNode(node, tuple(seq.token_ids[i * bs:full * bs]), list(seq.block_ids[i:full]), full)
            node.children[child.tokens[:bs]] = child
            for b in child.blocks:
                self.block_node[b] = child
            self.evictable += len(child.blocks)  # unlocked until the path below takes it
            if self.events is not None:
                self._record_stored(seq, i, full)
            node, i = child, full
        self._set_path(seq.seq_id, node)
        self._touch(node)
        if node.parent is None:  # nothing published (its blocks are held under other ids)
            self._drop_if_empty(node)

    def _record_stored(self, seq: Sequence, start: int, stop: int) -> None:
        """BlockStored for ``seq``'s blocks ``start .. stop`` (just put in the tree); their keys are
        kept for the BlockRemoved of their eviction."""
        keys = block_keys(seq.token_ids, self.block_size, stop, seq.block_hashes, seq.cache_salt)[:stop]
        self.block_key.update(zip(seq.block_ids[start:stop], keys[start:stop]))
        bs, lora = self.block_size, getattr(seq, "lora_request", None)
        self.record(BlockStored(keys[start:stop], keys[start - 1] if start else None,
                                list(seq.token_ids[start * bs:stop * bs]),
                                lora and lora.lora_int_id, lora and lora.lora_name))

    def _adopt(self, seq: Sequence, node: RadixNode, i: int, limit: int) -> tuple[RadixNode, int]:
        """Point ``seq``'s blocks ``i ..`` at the tree's blocks of the same content below ``node``
        (another sequence computed the same prefix in the same step) and release its own, as
        SGLang does: its path then goes on through the tree, and its later blocks are published
        below it. Returns the node reached and how many blocks were adopted.
        NOTE: safe between steps: the KV in both is the same tokens' at the same positions, and
        every step reads the block table afresh."""
        shared, j = self._follow(seq, node, i, limit, own=False)
        walk, blocks = shared, []
        while walk is not node:
            blocks[:0] = walk.blocks
            walk = walk.parent
        for k, block in enumerate(blocks, start=i):
            self.ref_counts[block] += 1
            self._release(seq.block_ids[k])  # private: never in the tree (published blocks stop at i)
            seq.block_ids[k] = block
        return shared, j - i

    def reset_prefix_cache(self) -> None:
        self.record(AllBlocksCleared())
        self.block_key.clear()
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            node.alive = False
            stack.extend(node.children.values())
        for block in self.block_node:
            if self.ref_counts[block] == 0:
                self.free_plain.append(block)
        self.block_node.clear()
        self.root.children.clear()
        self.roots = {b"": self.root}
        self.heap.clear()
        self.evictable = 0
        self.paths.clear()  # every sequence now holds private blocks only and stops publishing

    def check_integrity(self, holders: Iterable[Sequence] | None = None) -> None:
        super().check_integrity(holders)
        n, bs = self.num_blocks, self.block_size
        assert len(self.ref_counts) == n, "the reference-count table is not num_blocks long"
        plain = set(self.free_plain)
        assert len(plain) == len(self.free_plain), "a block is in the plain free list twice"
        assert all(0 <= b < n for b in plain), "the plain free list holds a block id out of range"
        # The tree: edges of whole blocks, children under their first block's tokens, each block once.
        locks: Counter[int] = Counter()
        for node in self.paths.values():
            assert node.alive, "a sequence's path ends at an evicted node"
            walk = node
            while walk.parent is not None:
                locks[id(walk)] += 1
                walk = walk.parent
            assert any(walk is root for root in self.roots.values()), "a sequence's path does not lead to a root"
        seen: set[int] = set()
        unlocked_leaves: set[int] = set()
        evictable = 0
        assert self.roots.get(b"") is self.root, "the base model's tree is gone"
        for salt, root in self.roots.items():
            assert root.parent is None and not root.blocks and root.end == 0, "a tree's root is not a root"
            assert root.children or root is self.root, f"an empty tree is kept for {salt!r}"
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.alive and child.parent is node, "a child does not name its parent"
                assert child.blocks and len(child.tokens) == len(child.blocks) * bs, (
                    f"an edge of {len(child.tokens)} tokens holds {len(child.blocks)} blocks of {bs}")
                assert key == child.tokens[:bs], "a child is keyed by other tokens than its first block's"
                assert child.end == node.end + len(child.blocks), "a node's depth is wrong"
                assert child.lock_ref == locks[id(child)], (
                    f"a node has lock_ref {child.lock_ref} but {locks[id(child)]} sequence paths through it")
                for b in child.blocks:
                    assert 0 <= b < n and b not in seen, f"tree block {b} out of range or in the tree twice"
                    seen.add(b)
                    assert self.block_node.get(b) is child, f"tree block {b} is not indexed to its node"
                    assert b not in plain, f"block {b} is both in the tree and plain free"
                    assert (self.ref_counts[b] == 0) == (child.lock_ref == 0), (
                        f"tree block {b} has reference count {self.ref_counts[b]} in a node locked {child.lock_ref}")
                evictable += len(child.blocks) if child.lock_ref == 0 else 0
                if child.lock_ref == 0 and not child.children:
                    unlocked_leaves.add(id(child))
                stack.append(child)
        assert seen == set(self.block_node), "the block index names blocks outside the tree"
        assert evictable == self.evictable, f"{self.evictable} blocks counted evictable, {evictable} are"
        in_heap = {id(e[2]) for e in self.heap if self._evictable_leaf(e)}
        assert unlocked_leaves <= in_heap, "an evictable leaf is missing from the eviction heap"
        for block, refs in enumerate(self.ref_counts):
            assert refs >= 0, f"block {block} has reference count {refs}"
            if block not in seen:
                assert (refs == 0) == (block in plain), (
                    f"block {block} has reference count {refs} but is {'' if block in plain else 'not '}plain free")
        assert self.num_free_blocks() == len(plain) + evictable
        if holders is not None:
            holders = list(holders)
            self.check_reference_counts(holders)
            for seq in holders:
                node = self.paths.get(seq.seq_id)
                if node is not None:
                    assert seq.block_ids[node.end - len(node.blocks):node.end] == node.blocks, (
                        f"sequence {seq.seq_id}'s path is not the start of its block table")
                    while node.parent is not None:
                        node = node.parent
                    assert node is self.roots.get(seq.cache_salt), (
                        f"sequence {seq.seq_id}'s path is in another adapter's tree")

    def num_cached_blocks(self) -> int:
        return len(self.block_node)
