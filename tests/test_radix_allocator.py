"""The radix-tree prefix cache (kv_allocator: radix) on its own: hits, edge splits, LRU leaf
eviction, path locks, copy-on-write, reset. The conformance kit runs it too (tests/broken_plugins.py
CONTROLS), and the engine's greedy-equality tests are parametrized over it."""

from __future__ import annotations

from typing import Iterator

import pytest

from modserve.core.sampling_params import SamplingParams
from modserve.core.sequence import Sequence
from modserve.plugins.kv_allocators.radix import RadixAllocator, RadixNode, RadixOptions

BS = 4


@pytest.fixture
def make() -> Iterator:
    """Builds allocators; after the test every block must be free and the books straight."""
    made: list[RadixAllocator] = []

    def build(num_blocks: int = 16, caching: bool = True) -> RadixAllocator:
        made.append(RadixAllocator(num_blocks, BS, 64, RadixOptions(enable_prefix_caching=caching)))
        return made[-1]

    yield build
    for alloc in made:
        alloc.check_integrity([])
        assert alloc.num_free_blocks() == alloc.num_blocks


def seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, str(i), list(tokens), len(tokens), SamplingParams(), 0.0)


def admit(alloc: RadixAllocator, s: Sequence, *others: Sequence) -> int:
    """What the scheduler does for a new prompt, computed in one step; returns the hit."""
    hit = alloc.match_prefix(s)
    s.num_computed_tokens = hit
    alloc.check_integrity([s, *others])
    assert alloc.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    alloc.mark_computed(s)
    alloc.check_integrity([s, *others])
    return hit


def free(alloc: RadixAllocator, *seqs: Sequence, holders: tuple[Sequence, ...] = ()) -> None:
    for s in seqs:
        alloc.free(s)
    alloc.check_integrity(list(holders))


def edges(node: RadixNode) -> dict:
    """The tree as nested dicts: first token of each edge -> (edge length in blocks, its children)."""
    return {key[0]: (len(c.blocks), edges(c)) for key, c in node.children.items()}


def test_shared_prefix_hits_across_requests(make):
    alloc = make()
    a = seq(0, list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(alloc, a) == 0
    first_two = a.block_ids[:2]
    free(alloc, a)
    assert alloc.stats()["cached_blocks"] == 2
    b = seq(1, list(range(8)) + [50, 51, 52])
    assert admit(alloc, b) == 8 and b.block_ids[:2] == first_two
    c = seq(2, [99] + list(range(1, 10)))  # first block differs: no hit, though block 2 is equal
    assert admit(alloc, c, b) == 0
    stats = alloc.stats()
    assert stats["prefix_hit_tokens"] == 8 and stats["prefix_queried_tokens"] == 10 + 11 + 10
    free(alloc, b, c)


def test_partial_match_splits_the_edge_at_a_block_boundary(make):
    alloc = make()
    a = seq(0, list(range(17)))  # 4 full blocks: one edge
    admit(alloc, a)
    free(alloc, a)
    assert edges(alloc.root) == {0: (4, {})}
    b = seq(1, list(range(8)) + [90, 91, 92, 93, 94])  # the first 2 blocks match, the third differs
    assert admit(alloc, b) == 8
    assert edges(alloc.root) == {0: (2, {8: (2, {}), 90: (1, {})})}
    free(alloc, b)
    c = seq(2, list(range(16)) + [7])  # the whole old edge, through the split
    assert admit(alloc, c) == 16
    free(alloc, c)


def test_match_leaves_the_last_token(make):
    alloc = make()
    a = seq(0, list(range(9)))
    admit(alloc, a)
    free(alloc, a)
    b = seq(1, list(range(8)))  # 2 cached blocks hold all 8 tokens: only the first may be a hit
    assert admit(alloc, b) == 4
    assert edges(alloc.root) == {0: (1, {4: (1, {})})}  # split where the match had to stop
    free(alloc, b)


def test_eviction_takes_lru_leaves_never_a_held_inner_node(make):
    alloc = make(num_blocks=6)
    a = seq(0, list(range(8)) + [100])  # tree: [a0 a1]
    admit(alloc, a)
    free(alloc, a)
    b = seq(1, list(range(4)) + [200, 201, 202, 203, 204])  # holds a0; its own block under it
    assert admit(alloc, b) == 4
    assert edges(alloc.root) == {0: (1, {4: (1, {}), 200: (1, {})})}
    assert alloc.num_free_blocks() == 3  # 2 plain + a1 (an unlocked leaf)
    c = seq(2, list(range(300, 312)))
    assert admit(alloc, c, b) == 0  # takes both plain blocks, then evicts a1
    assert alloc.stats()["evictions"] == 1 and alloc.num_free_blocks() == 0
    assert edges(alloc.root) == {0: (1, {200: (1, {})}), 300: (3, {})}  # a0, held below, stays
    d = seq(3, [1])
    assert not alloc.allocate(d, 1)
    free(alloc, b, holders=(c,))
    free(alloc, c)


def test_eviction_order_is_least_recently_used(make):
    alloc = make(num_blocks=4)
    a, b = seq(0, [1, 2, 3, 4, 5]), seq(1, [6, 7, 8, 9, 10])
    admit(alloc, a)
    admit(alloc, b, a)
    free(alloc, a, b)
    again = seq(2, [1, 2, 3, 4, 11])
    assert admit(alloc, again) == 4  # a's block is now the more recently used
    free(alloc, again)
    big = seq(3, list(range(100, 112)))  # 3 blocks: 2 plain, then one evicted
    admit(alloc, big)
    free(alloc, big)
    assert alloc.stats()["evictions"] >= 1
    assert admit(alloc, probe := seq(4, [1, 2, 3, 4, 0])) == 4
    free(alloc, probe)
    assert admit(alloc, probe := seq(5, [6, 7, 8, 9, 0])) == 0  # b's was the one evicted
    free(alloc, probe)


def test_path_locks_follow_holders_and_are_released_on_free(make):
    alloc = make()
    a = seq(0, list(range(9)))
    admit(alloc, a)
    x, y = seq(1, list(range(9))), seq(2, list(range(9)))
    admit(alloc, x, a)
    admit(alloc, y, a, x)
    (node,) = alloc.root.children.values()
    assert node.lock_ref == 3 and alloc.num_free_blocks() == 16 - 2 - 3  # 2 shared, 3 own last blocks
    free(alloc, a, x, holders=(y,))
    assert node.lock_ref == 1
    free(alloc, y)
    assert node.lock_ref == 0 and alloc.num_free_blocks() == 16


def test_copy_on_write_of_a_shared_partial_block_after_fork(make):
    alloc = make(num_blocks=8)
    parent = seq(0, list(range(6)))  # 1 full block (cached) + a partial one
    admit(alloc, parent)
    child = seq(1, list(range(6)))
    child.num_computed_tokens = 6
    alloc.fork(parent, child)
    alloc.check_integrity([parent, child])
    (node,) = alloc.root.children.values()
    assert node.lock_ref == 2 and child.block_ids == parent.block_ids
    partial = parent.block_ids[1]
    assert alloc.blocks_needed(child, 7) == 1 and alloc.allocate(child, 7)
    assert child.block_ids[0] == parent.block_ids[0] and alloc.take_copies() == [(partial, child.block_ids[1])]
    alloc.check_integrity([parent, child])
    assert alloc.blocks_freed_by(parent) == 1  # the partial block; the cached one is the child's too
    free(alloc, parent, holders=(child,))
    free(alloc, child)


def test_duplicate_content_is_adopted_and_what_follows_it_is_cached(make):
    """Two prompts sharing 2 blocks, prefilled side by side (neither could hit the other): the
    second swaps its copies of the shared blocks for the tree's (SGLang's insert) and frees
    them, so its own third block is published below the shared prefix and a later prompt
    that extends it hits all three."""
    alloc = make()
    a, b = seq(0, list(range(8)) + [50, 51, 52, 53, 99]), seq(1, list(range(8)) + [60, 61, 62, 63, 99])
    for s in (a, b):
        assert alloc.match_prefix(s) == 0 and alloc.allocate(s, 13)
    free_before = alloc.num_free_blocks()
    own_copies = b.block_ids[:2]
    for s in (a, b):
        s.num_computed_tokens = 13
        alloc.mark_computed(s)
        alloc.check_integrity([a, b])
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]  # adopted, then its own
    assert alloc.num_free_blocks() == free_before + 2 and all(blk in alloc.free_plain for blk in own_copies)
    assert alloc.stats()["cached_blocks"] == 4  # the shared 2 once, each prompt's third
    assert edges(alloc.root) == {0: (2, {50: (1, {}), 60: (1, {})})}
    c = seq(2, list(range(8)) + [60, 61, 62, 63, 7, 7])
    assert admit(alloc, c, a, b) == 12
    free(alloc, b, holders=(a, c))
    free(alloc, a, c)


def test_trim_below_the_path_shortens_it(make):
    alloc = make()
    a = seq(0, list(range(13)))
    admit(alloc, a)
    alloc.trim(a, 5)  # keeps 2 blocks; the tree keeps all 3 full blocks
    a.num_computed_tokens = 5
    alloc.check_integrity([a])
    free(alloc, a)
    assert alloc.stats()["cached_blocks"] == 3


def test_reset_prefix_cache_forgets_everything_but_held_blocks(make):
    alloc = make()
    a, b = seq(0, list(range(9))), seq(1, list(range(20, 29)))
    admit(alloc, a)
    admit(alloc, b, a)
    free(alloc, a, holders=(b,))
    alloc.reset_prefix_cache()
    alloc.check_integrity([b])
    assert alloc.stats()["cached_blocks"] == 0 and alloc.num_free_blocks() == 16 - 3
    b.token_ids += [1, 2, 3]
    assert alloc.allocate(b, b.num_tokens)
    b.num_computed_tokens = b.num_tokens
    alloc.mark_computed(b)  # its early blocks are gone from the tree: it publishes nothing more
    alloc.check_integrity([b])
    assert alloc.stats()["cached_blocks"] == 0
    free(alloc, b)
    assert admit(alloc, again := seq(2, list(range(9)))) == 0
    free(alloc, again)


def test_no_prefix_caching_caches_nothing(make):
    alloc = make(caching=False)
    a = seq(0, list(range(9)))
    admit(alloc, a)
    free(alloc, a)
    assert admit(alloc, b := seq(1, list(range(9)))) == 0 and alloc.stats()["cached_blocks"] == 0
    free(alloc, b)


def test_an_unheld_inner_node_outlives_its_leaves(make):
    alloc = make(num_blocks=4)
    a = seq(0, [0, 1, 2, 3, 9])
    admit(alloc, a)
    free(alloc, a)  # its node is the least recently used leaf...
    b = seq(1, [0, 1, 2, 3, 10, 11, 12, 13, 9])
    assert admit(alloc, b) == 4
    free(alloc, b)  # ...until b hangs a child under it: now the child is the leaf to evict
    assert edges(alloc.root) == {0: (1, {10: (1, {})})}
    c = seq(2, list(range(100, 112)))  # 2 plain blocks, then one evicted
    admit(alloc, c)
    assert edges(alloc.root) == {0: (1, {}), 100: (3, {})} and alloc.stats()["evictions"] == 1
    free(alloc, c)
    assert admit(alloc, probe := seq(3, [0, 1, 2, 3, 5])) == 4
    free(alloc, probe)


def test_cached_prefix_tokens_peeks_what_match_prefix_would_attach(make):
    alloc = make()
    a = seq(0, list(range(17)))
    admit(alloc, a)
    free(alloc, a)
    for tokens in (list(range(8)) + [90, 91, 92], list(range(16)), list(range(17)), [5, 6, 7, 8, 9]):
        s = seq(1, tokens)
        before = (edges(alloc.root), alloc.stats())
        peek = alloc.cached_prefix_tokens(s)
        assert (edges(alloc.root), alloc.stats()) == before  # changes nothing, not even a split
        assert admit(alloc, s) == peek
        free(alloc, s)


def test_the_eviction_heap_stays_bounded_without_eviction_pressure(make):
    alloc = make()
    for i in range(300):  # each free pushes the leaf again; nothing is ever evicted
        s = seq(i, list(range(9)) if i % 2 else list(range(50, 59)))
        admit(alloc, s)
        free(alloc, s)
    assert len(alloc.heap) <= 2 * alloc.stats()["cached_blocks"] + 64 + 1
    big = seq(300, list(range(100, 164)))  # the whole pool: every cached block is evicted
    admit(alloc, big)
    assert alloc.stats()["evictions"] == 4 and alloc.stats()["cached_blocks"] == 16
    free(alloc, big)


def test_each_lora_adapter_has_its_own_tree(make):
    """Adapters' KV differs for the same tokens: a prefix cached under one is never matched under
    another or the base model; under the same adapter it is. An adapter's tree goes when empty."""
    from modserve.core.lora_request import LoRARequest

    alloc = make(num_blocks=12)
    alloc.enable_events()
    sql, chat = LoRARequest("sql", 1, "/a/sql"), LoRARequest("chat", 2, "/a/chat")
    tokens = list(range(9))  # 2 full blocks + 1 token
    a = seq(0, tokens)
    a.lora_request = sql
    assert admit(alloc, a) == 0
    stored = [e for e in alloc.take_events() if type(e).__name__ == "BlockStored"]
    assert [(e.lora_id, e.lora_name) for e in stored] == [(1, "sql")]
    b, c, d = seq(1, tokens), seq(2, tokens), seq(3, tokens)
    b.lora_request, d.lora_request = chat, sql
    assert admit(alloc, b, a) == 0 and admit(alloc, c, a, b) == 0  # another adapter, the base model: no hit
    assert admit(alloc, d, a, b, c) == 8 and d.block_ids[:2] == a.block_ids[:2]  # the same adapter: a hit
    assert set(alloc.roots) == {b"", sql.cache_salt, chat.cache_salt}
    free(alloc, a, b, c, d)
    e = seq(4, list(range(100, 145)))  # 12 blocks: every cached block is evicted for it
    assert admit(alloc, e) == 0
    assert set(alloc.roots) == {b""}  # the adapters' trees went with their last blocks
    free(alloc, e)
