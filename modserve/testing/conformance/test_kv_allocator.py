"""KVAllocator: block bookkeeping under the engine's operations, checked after each one.

The checks after every operation (:class:`.kv_workload.KVWorkload`): the allocator's own
``check_integrity`` and the base class's, and that every sequence's computed positions still
hold its own KV in a model of the cache's contents.
"""

from __future__ import annotations

import pytest

from modserve.api import KVAllocator
from modserve.testing.conformance.kv_events import EventCheckedWorkload
from modserve.testing.conformance.kv_workload import KVWorkload
from modserve.testing.conformance.targets import Implementation

CONFORMANCE_KIND = "kv_allocator"

NUM_BLOCKS, MAX_MODEL_LEN = 40, 64
BLOCK_SIZES = [4, 16]  # 4: a sequence spans many blocks and the pool runs short


def make(implementation: Implementation, block_size: int) -> KVAllocator:
    alloc = implementation.create(NUM_BLOCKS, block_size, MAX_MODEL_LEN)
    assert alloc.num_free_blocks() == alloc.num_blocks, (
        f"a new allocator has {alloc.num_free_blocks()} free blocks of num_blocks={alloc.num_blocks}")
    return alloc


def assert_all_free(work: KVWorkload, when: str) -> None:
    alloc = work.alloc
    assert alloc.num_free_blocks() == alloc.num_blocks, (
        f"{when}, num_free_blocks() = {alloc.num_free_blocks()}; it must be num_blocks = {alloc.num_blocks} "
        f"(blocks kept only as prefix cache count as free): {alloc.num_blocks - alloc.num_free_blocks()} leaked")
    work.check(when)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_operations_keep_the_books(implementation: Implementation, block_size: int, seed: int) -> None:
    """A seeded random mix of admissions (``match_prefix``, ``allocate``), prefill chunks, decodes,
    speculative decodes (``trim``), forks, preemptions, frees and ``reset_prefix_cache``: after each,
    the books are consistent and no sequence's KV was lost; at the end every block is free."""
    work = KVWorkload(make(implementation, block_size), seed)
    work.run(300)
    assert_all_free(work, "after freeing every sequence")


@pytest.mark.parametrize("seed", [0, 1])
def test_kv_events_say_what_is_cached(implementation: Implementation, seed: int) -> None:
    """With ``reports_events``: the events of the random mix above, replayed as a router does,
    hold every block ``cached_prefix_tokens`` finds, remove only what they stored, and each
    ``BlockStored`` is its parent's key chain over its tokens (``kv_events.EventCheckedWorkload``)."""
    alloc = make(implementation, 4)
    if not alloc.reports_events:
        pytest.skip(f"{type(alloc).__name__} does not report KV cache events (reports_events is False)")
    work = EventCheckedWorkload(alloc, seed)
    work.run(300)
    assert_all_free(work, "after freeing every sequence")
    assert work.counts["BlockStored"], "the workload cached blocks, but no BlockStored was recorded"


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_allocate_is_all_or_nothing(implementation: Implementation, block_size: int) -> None:
    """When the pool runs short, ``allocate`` returns False and changes nothing (a new sequence,
    one growing past what is free; with nothing free and with too little)."""
    work = KVWorkload(make(implementation, block_size), seed=2)
    refused = 0
    for _ in range(NUM_BLOCKS + 1):  # one block (or slab) at a time until the pool is empty
        seq = work.new_sequence([1] * block_size)
        if not work.allocate(seq, block_size):  # checks the refusal changed nothing
            refused += 1
            break
        work.live.append(seq)
        work.check(f"allocating sequence {seq.seq_id}")
    assert refused, f"{NUM_BLOCKS + 1} sequences of one block each were all allocated from {NUM_BLOCKS} blocks"
    for free_first in (False, True):  # nothing free, then what one sequence gave back
        if free_first:
            work.free(work.live[0])
        for seq in (work.new_sequence([2] * MAX_MODEL_LEN), work.live[-1]):
            if work.allocate(seq, MAX_MODEL_LEN) and seq not in work.live:  # a refusal must change nothing
                work.live.append(seq)
            work.check(f"allocating {MAX_MODEL_LEN} tokens for sequence {seq.seq_id} "
                       f"with {work.alloc.num_free_blocks()} blocks free")
    for seq in list(work.live):
        work.free(seq)
    assert_all_free(work, "after freeing every sequence")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_freeing_everything_frees_every_block(implementation: Implementation, block_size: int) -> None:
    """After ``free`` of every live sequence (prefixes published by ``mark_computed`` included),
    ``num_free_blocks() == num_blocks``."""
    work = KVWorkload(make(implementation, block_size), seed=3)
    for length in (1, block_size, block_size + 3, 2 * block_size):
        seq = work.new_sequence([length % 7 + t for t in range(length)])
        work.admit(seq)
    for seq in list(work.live):
        work.free(seq)
    assert_all_free(work, "after freeing every sequence")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_fork_shares_then_copies_on_write(implementation: Implementation, block_size: int) -> None:
    """``fork`` shares every block of the parent; the first write into the shared partial block
    gets a copy first, reported by ``take_copies``, and neither sequence loses its KV."""
    work = KVWorkload(make(implementation, block_size), seed=4)
    parent = work.new_sequence(list(range(block_size + block_size // 2)))  # ends mid-block
    work.live.append(parent)
    assert work.allocate(parent, parent.num_tokens), "a fresh pool must take one prompt"
    work.write(parent, parent.num_tokens)
    parent.num_computed_tokens = parent.num_tokens
    work.alloc.mark_computed(parent)
    child = work.fork(parent)
    if child is None:
        pytest.skip(f"{implementation} does not support fork (NotImplementedError)")
    parent.token_ids.append(7)
    shared = child.block_ids[-1]
    for seq in (child, parent):  # the child writes first: the block is shared when it does
        assert work.allocate(seq, seq.num_tokens), "a nearly empty pool must take one more token"
        work.write(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        work.alloc.mark_computed(seq)
        work.check(f"a decode of sequence {seq.seq_id} after the fork")
    assert child.block_ids[-1] != parent.block_ids[-1], (
        f"after both decoded, parent and child still share their last block {shared}: one of them must "
        f"have been given a copy")
    for seq in (child, parent):
        work.free(seq)
    assert_all_free(work, "after freeing parent and child")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_match_prefix_leaves_the_last_token(implementation: Implementation, block_size: int) -> None:
    """A prompt whose every block is cached still gets fewer tokens from ``match_prefix`` than it
    has (its last token is computed for the logits), and what matches is its own prefix."""
    work = KVWorkload(make(implementation, block_size), seed=5, fork_rate=0.0)
    prompt = list(range(2 * block_size))  # whole blocks only: all of them may be cached
    first = work.new_sequence(prompt)
    work.admit(first)
    while first.num_computed_tokens < first.num_prompt_tokens:
        assert work.advance(first), "a nearly empty pool must take one prompt"
    work.free(first)
    again = work.new_sequence(prompt)
    work.admit(again)  # asserts the match is short of the prompt and holds its KV
    work.free(again)
    assert_all_free(work, "after freeing both sequences")
