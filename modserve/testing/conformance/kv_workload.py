"""Drives a KV allocator as the engine does, and models what its blocks hold.

The model writes, for every computed position, a fingerprint of the token prefix up to it
(the KV there depends on all of it) into the slot the sequence's block table gives, and
applies the copies ``take_copies`` reports. A sequence's computed positions must always read
back its own fingerprints: a block handed out twice, a copy-on-write done in place or not
reported, a prefix match onto the wrong blocks all show up as a position that does not.
"""

from __future__ import annotations

import random
from typing import Iterable

from modserve.api import KVAllocator, SamplingParams, Sequence

VOCAB = 40


class KVWorkload:
    def __init__(self, allocator: KVAllocator, seed: int, fork_rate: float = 0.2) -> None:
        self.alloc = allocator
        self.fork_rate = fork_rate  # of steps that finish a prompt: the samples of an n > 1 request
        self.bs = allocator.block_size
        self.rng = random.Random(seed)
        self.live: list[Sequence] = []  # holding blocks
        self.waiting: list[Sequence] = []  # no blocks, tokens kept (new or preempted)
        self.slots: dict[int, list[int | None]] = {}  # block -> fingerprint per offset
        self.prints: dict[int, list[int]] = {}  # seq_id -> fingerprint of each prefix
        self.next_id = 0
        self.fork_supported: bool | None = None
        # A few shared prompt stems, so prefixes repeat and a prefix cache gets hits.
        self.stems = [[self.rng.randrange(VOCAB) for _ in range(3 * self.bs)] for _ in range(3)]

    # -- sequences --------------------------------------------------------------------
    def new_sequence(self, prompt: list[int] | None = None) -> Sequence:
        if prompt is None:
            stem = self.rng.choice(self.stems)
            prompt = stem[: self.rng.randint(1, len(stem))] + [self.rng.randrange(VOCAB)
                                                               for _ in range(self.rng.randint(0, 5))]
        seq = Sequence(self.next_id, f"r{self.next_id}", list(prompt), len(prompt), SamplingParams(), 0.0)
        self.next_id += 1
        return seq

    def fingerprints(self, seq: Sequence, extra: Iterable[int] = ()) -> list[int]:
        """Fingerprint of ``seq``'s prefix ending at each position (``extra``: draft tokens after it)."""
        prints = self.prints.setdefault(seq.seq_id, [])
        for tok in seq.token_ids[len(prints):]:
            prints.append(hash((prints[-1] if prints else 0, tok)))
        out = prints
        for tok in extra:
            out = out + [hash((out[-1], tok))]
        return out

    # -- the allocator's operations, each checked ---------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """``allocate`` with its contract checked; applies the copies it reports."""
        alloc, old = self.alloc, list(seq.block_ids)
        needed, free = alloc.blocks_needed(seq, num_tokens), alloc.num_free_blocks()
        ok = alloc.allocate(seq, num_tokens)
        what = f"allocate(sequence {seq.seq_id}, {num_tokens} tokens)"
        if not ok:
            assert needed > free, (f"{what} refused, though blocks_needed() said {needed} and "
                                   f"num_free_blocks() {free}: the scheduler relies on the two")
            assert seq.block_ids == old and alloc.num_free_blocks() == free, (
                f"{what} failed but changed the table from {old} to {seq.block_ids} and the free count "
                f"from {free} to {alloc.num_free_blocks()}: a failed allocate must change nothing")
            return False
        taken = free - alloc.num_free_blocks()
        assert taken <= needed, f"{what} took {taken} free blocks; blocks_needed() said {needed}"
        assert len(seq.block_ids) * self.bs >= num_tokens, (
            f"{what} succeeded but the table {seq.block_ids} covers only {len(seq.block_ids) * self.bs} tokens")
        copies = alloc.take_copies()
        for src, dst in copies:
            self.slots[dst] = list(self.slots.get(src, [None] * self.bs))  # the engine copies the block
        computed_blocks = -(-seq.num_computed_tokens // self.bs)
        for i in range(min(len(old), computed_blocks)):
            if seq.block_ids[i] != old[i]:
                assert (old[i], seq.block_ids[i]) in copies, (
                    f"{what} replaced block {old[i]} (entry {i}, holding computed tokens) by {seq.block_ids[i]} "
                    f"without reporting the copy ({old[i]}, {seq.block_ids[i]}) in take_copies() {copies}")
        return True

    def write(self, seq: Sequence, end: int, drafts: Iterable[int] = ()) -> None:
        """Store KV for positions ``num_computed_tokens .. end - 1``, as a forward would."""
        prints = self.fingerprints(seq, drafts)
        for pos in range(seq.num_computed_tokens, end):
            block = seq.block_ids[pos // self.bs]
            holders = [s.seq_id for s in self.live if s is not seq and block in s.block_ids]
            assert not holders, (
                f"sequence {seq.seq_id} is about to write position {pos} into block {block}, which sequences "
                f"{holders} also hold: a shared block is never written in place (allocate must copy it first)")
            self.slots.setdefault(block, [None] * self.bs)[pos % self.bs] = prints[pos]

    def check(self, when: str) -> None:
        holders = list(self.live)
        try:
            self.alloc.check_integrity(holders)
            KVAllocator.check_integrity(self.alloc, holders)  # the base checks, whatever a subclass does
        except (AssertionError, ValueError) as e:
            raise AssertionError(f"after {when}: check_integrity found: {e}") from e
        for seq in self.live:
            prints = self.fingerprints(seq)
            for pos in range(seq.num_computed_tokens):
                block = seq.block_ids[pos // self.bs]
                assert self.slots.get(block, [None] * self.bs)[pos % self.bs] == prints[pos], (
                    f"after {when}: sequence {seq.seq_id}'s KV at position {pos} (block {block}) is not its own: "
                    f"the block was handed to another sequence, overwritten, or matched to the wrong prefix")

    # -- what the engine does -------------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        assert not seq.block_ids, f"sequence {seq.seq_id} should hold no blocks while waiting"
        hit = self.alloc.match_prefix(seq)
        assert 0 <= hit < seq.num_tokens, (
            f"match_prefix(sequence of {seq.num_tokens} tokens) = {hit}: it must be fewer than all "
            f"tokens (the last is computed for its logits)")
        assert hit <= len(seq.block_ids) * self.bs, f"match_prefix covered {hit} tokens with {seq.block_ids}"
        seq.num_computed_tokens = hit
        self.live.append(seq)
        self.check(f"match_prefix of sequence {seq.seq_id} ({hit} tokens)")
        if not self.advance(seq):
            self.preempt(seq)

    def advance(self, seq: Sequence) -> bool:
        """One step of ``seq``: a prefill chunk, a decode, or a speculative decode. False: no blocks."""
        start, remaining = seq.num_computed_tokens, seq.num_tokens - seq.num_computed_tokens
        room = self.alloc.max_model_len - seq.num_tokens
        drafts = [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 3))] \
            if remaining == 1 and room > 4 and self.rng.random() < 0.3 else []
        n = self.rng.randint(1, remaining) if remaining > 1 else 1 + len(drafts)
        if not self.allocate(seq, start + n):
            return False
        self.write(seq, start + n, drafts)
        accepted = self.rng.randint(0, len(drafts)) if drafts else 0
        seq.token_ids.extend(drafts[:accepted])
        seq.num_computed_tokens = start + (1 + accepted if drafts else n)
        if drafts:
            self.alloc.trim(seq, seq.num_computed_tokens)  # the rejected slots go back
        self.alloc.mark_computed(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            if self.fork_supported is not False and self.rng.random() < self.fork_rate:
                self.fork(seq)
            seq.token_ids.append(self.rng.randrange(VOCAB))  # the sampled token
        self.check(f"a step of sequence {seq.seq_id} ({n} tokens from position {start})")
        return True

    def fork(self, parent: Sequence) -> Sequence | None:
        child = Sequence(self.next_id, parent.request_id, list(parent.token_ids), parent.num_prompt_tokens,
                         parent.params, 0.0, num_computed_tokens=parent.num_computed_tokens)
        try:
            self.alloc.fork(parent, child)
        except NotImplementedError:
            self.fork_supported = False
            return None
        self.fork_supported = True
        self.next_id += 1
        assert child.block_ids == parent.block_ids, (
            f"fork: the child's table {child.block_ids} must be the parent's {parent.block_ids} (shared blocks)")
        self.live.append(child)
        child.token_ids.append(self.rng.randrange(VOCAB))  # its own sample
        self.check(f"a fork of sequence {parent.seq_id}")
        return child

    def free(self, seq: Sequence) -> None:
        self.alloc.free(seq)
        assert not seq.block_ids, f"free(sequence {seq.seq_id}) left its table {seq.block_ids}"
        self.live.remove(seq)
        self.check(f"free(sequence {seq.seq_id})")

    def preempt(self, seq: Sequence) -> None:
        self.free(seq)
        seq.num_computed_tokens = 0
        self.waiting.append(seq)

    def run(self, num_ops: int) -> None:
        """A seeded random mix of arrivals, admissions, steps, preemptions and finishes."""
        for _ in range(num_ops):
            r = self.rng.random()
            if r < 0.15 and len(self.waiting) < 6:
                self.waiting.append(self.new_sequence())
            elif r < 0.35 and self.waiting:
                self.admit(self.waiting.pop(self.rng.randrange(len(self.waiting))))
            elif r < 0.85 and self.live:
                seq = self.rng.choice(self.live)
                if seq.num_tokens >= self.alloc.max_model_len - 1:
                    self.free(seq)
                elif not self.advance(seq):
                    self.preempt(self.rng.choice(self.live))
            elif r < 0.9 and self.live:
                self.preempt(self.rng.choice(self.live))
            elif r < 0.98 and self.live:
                self.free(self.rng.choice(self.live))
            else:
                self.alloc.reset_prefix_cache()
                self.check("reset_prefix_cache()")
        for seq in list(self.live):
            self.free(seq)
