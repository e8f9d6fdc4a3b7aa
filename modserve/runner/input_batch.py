"""The runner's persistent input batch: rows kept across steps, only what changed written.

Each sequence of the last step keeps a row: its block table row in a preallocated numpy
array (a row's columns past its blocks are 0), with the block ids written there, and its
sampling settings as numbers. A step whose sequences are the last one's, in the same order
(every step of a steady decode), moves no row; one where sequences join, leave or reorder
lays the rows out again in the step's order with one numpy gather (vLLM's condense, order
kept), and writes only the new sequences' rows. A row whose sequence gained blocks gets the
appended ids; one whose blocks changed otherwise (copy-on-write, a radix adoption, a trim)
is written again: a whole list compare per row finds either. The sampler's per-row tensors
of a batch whose rows have no per-step rules (seeds, logprobs, token rules, min_tokens, a
grammar) come from the settings' rows, with no pass over the sequences.

The step's tensors are views of one staging buffer (``torch.from_numpy`` once): their
values land there with one list assignment and one block-table copy, then one copy to the
device where it is not the host. NOTE: a step's tensors stay valid while ``depth - 1``
later steps are prepared (the staging buffers are a ring): enough for a batch in flight per
pipeline stage. Where the step is pickled to other ranks (``sent``), its tensors get one
storage of their own first: a pickled view carries its whole storage.
"""

from __future__ import annotations

import numpy as np
import torch

from modserve.core.contracts.attention_backend import AttentionMetadata
from modserve.core.contracts.sampler import SamplingBatch
from modserve.core.sequence import Sequence
from modserve.runner.batch import SMALL_DECODE_STEP

# SamplingParams' float settings, one row each in InputBatch.settings, in SamplingBatch's order less top_k
SETTINGS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class InputBatch:
    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device,
                 depth: int = 2, sent: bool = False) -> None:
        self.block_size = block_size
        self.device = device
        self.on_host = device.type == "cpu"
        self.sent = sent
        self.block_table = np.zeros((max_rows, max_blocks), dtype=np.int64)  # [R, max_blocks], rows 0-padded
        # [6, R] float64: compared as SamplingParams' floats are; float32 tensors are made from them
        self.settings = np.zeros((len(SETTINGS), max_rows), dtype=np.float64)
        self.top_k = np.zeros(max_rows, dtype=np.int64)  # [R], 0 = off
        self.special = np.zeros(max_rows, dtype=bool)  # [R] the row has a rule the sampler reads per step
        self.any_special = False  # among rows 0 .. n - 1
        self.seqs: list[Sequence] = []  # row -> its sequence: the last step's, in its order
        self.written: list[list[int]] = []  # row -> the block ids in its table row
        self._staging = [Staging(1 << 12) for _ in range(max(depth, 1))]
        self._turn = 0
        self._version = 0  # counts the writes to block_table: a staged table still current is not copied again

    # -- rows -------------------------------------------------------------------------
    def place(self, seqs: list[Sequence]) -> None:
        """Give ``seqs`` rows ``0 .. n - 1`` in order (kept rows move, new ones are written) and
        bring every row's blocks up to date."""
        if seqs != self.seqs:  # NOTE: Sequence compares by identity: a C-level list compare
            self._lay_out(seqs)
        written = self.written
        for row, seq in enumerate(seqs):
            if seq.block_ids != written[row]:
                self._write_blocks(row, seq.block_ids, written[row])

    def _lay_out(self, seqs: list[Sequence]) -> None:
        n = len(seqs)
        self._version += 1
        if n > self.block_table.shape[0]:
            self._grow(rows=n)
        old = {s: row for row, s in enumerate(self.seqs)}
        src = [old.get(s, -1) for s in seqs]
        moved = [(dst, r) for dst, r in enumerate(src) if r >= 0 and r != dst]
        if moved:
            dst, r = np.array(moved, dtype=np.int64).T
            self.block_table[dst] = self.block_table[r]  # the right side is a copy: overlaps are safe
            self.settings[:, dst] = self.settings[:, r]
            self.top_k[dst], self.special[dst] = self.top_k[r], self.special[r]
        written = [self.written[r] if r >= 0 else None for r in src]
        for row, r in enumerate(src):
            if r < 0:
                self.block_table[row] = 0
                written[row] = []
                self._write_settings(row, seqs[row])
        self.seqs, self.written = list(seqs), written
        self.any_special = bool(self.special[:n].any())

    def _write_blocks(self, row: int, blocks: list[int], written: list[int]) -> None:
        k = len(written)
        self._version += 1
        if len(blocks) > self.block_table.shape[1]:
            self._grow(cols=len(blocks))
        if len(blocks) >= k and blocks[:k] == written:  # appended only: write those
            self.block_table[row, k:len(blocks)] = blocks[k:]
            written.extend(blocks[k:])
            return
        self.block_table[row, : max(k, len(blocks))] = 0
        self.block_table[row, : len(blocks)] = blocks
        self.written[row] = list(blocks)

    def _write_settings(self, row: int, seq: Sequence) -> None:
        p = seq.params
        self.settings[:, row] = (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                                 p.frequency_penalty)
        self.top_k[row] = max(p.top_k, 0)
        self.special[row] = bool(p.min_tokens or p.logprobs is not None or p.allowed_token_ids
                                 or p.bad_words_token_ids or p.logit_bias or seq.generator is not None
                                 or seq.grammar is not None)

    # -- the sampler's rows ---------------------------------------------------------------
    def plain(self, seqs: list[Sequence]) -> bool:
        """Whether ``seqs`` are the batch's rows, in order, none with a rule the sampler reads
        per step (min_tokens, bad words, a grammar) or per row (a seed, logprobs, token rules)."""
        return not self.any_special and seqs == self.seqs

    def sampling_settings(self) -> SamplingBatch:
        """The rows' settings as the sampler's tensors ``[n]`` each (fresh ones: samplers may
        keep them while the rows change), for a batch that is :meth:`plain`."""
        n = len(self.seqs)
        f = self.settings[:, :n]
        floats = torch.from_numpy(f.astype(np.float32))  # [6, n], one copy
        top_k = torch.from_numpy(self.top_k[:n].copy())
        if not self.on_host:
            floats, top_k = floats.to(self.device), top_k.to(self.device)
        temperature, top_p, min_p, repetition, presence, frequency = floats
        return SamplingBatch(
            temperature, top_k, top_p, min_p, repetition, presence, frequency, all_greedy=not bool(f[0].any()),
            any_top_k=bool(self.top_k[:n].any()), any_top_p=bool((f[1] < 1.0).any()),
            any_min_p=bool((f[2] > 0).any()), any_penalty=bool((f[3] != 1.0).any() or f[4].any() or f[5].any()),
            generators={}, prompt_token_ids=None, output_token_ids=None, banned_token_ids=[], max_num_logprobs=-1)

    def _grow(self, rows: int = 0, cols: int = 0) -> None:
        r, c = self.block_table.shape
        table = np.zeros((max(r, rows), max(c, cols)), dtype=np.int64)
        table[:r, :c] = self.block_table
        settings = np.zeros((len(SETTINGS), table.shape[0]), dtype=np.float64)
        settings[:, :r] = self.settings
        top_k, special = np.zeros(table.shape[0], dtype=np.int64), np.zeros(table.shape[0], dtype=bool)
        top_k[:r], special[:r] = self.top_k, self.special
        self.block_table, self.settings, self.top_k, self.special = table, settings, top_k, special

    # -- one step's tensors -------------------------------------------------------------
    def prepare(self, seqs: list[Sequence], chunks: list[list[int]], context_lens: list[int],
                query_lens: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        """``build_batch``'s input ids [T] and metadata for ``seqs`` computing ``chunks`` from
        ``context_lens``, the same values, from the persistent rows."""
        self.place(seqs)
        n = len(seqs)
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        width = max(map(len, self.written))
        ids = [t for chunk in chunks for t in chunk] if n > 1 else chunks[0]
        num_tokens = len(ids)
        stage = self._stage(3 * num_tokens + 4 * n + 1 + n * width)
        array = stage.array
        end = 3 * num_tokens + 4 * n + 1
        max_query_len = max(query_lens)
        if max_query_len == 1 and num_tokens == n <= SMALL_DECODE_STEP:  # one token each, at its context length
            bs = self.block_size
            slots = [s.block_ids[p // bs] * bs + p % bs for s, p in zip(seqs, context_lens)]
            array[:end] = ids + context_lens + slots + list(range(n + 1)) + query_lens + context_lens + seq_lens
        else:
            q = np.array(query_lens, dtype=np.int64)
            t = num_tokens
            cu = array[3 * t : 3 * t + n + 1]
            cu[0] = 0
            np.cumsum(q, out=cu[1:])
            positions = array[t : 2 * t]
            # position of token t = t - start of its sequence's rows + that sequence's context length
            np.add(np.arange(t, dtype=np.int64), np.repeat(np.array(context_lens) - cu[:-1], q), out=positions)
            rows = np.repeat(np.arange(n), q)
            array[2 * t : 3 * t] = self.block_table[rows, positions // self.block_size] * self.block_size \
                + positions % self.block_size
            array[:t] = ids
            array[3 * t + n + 1 : end] = query_lens + context_lens + seq_lens
        if stage.table != (self._version, end, n, width):  # a steady decode: once per block_size steps
            array[end : end + n * width].reshape(n, width)[:] = self.block_table[:n, :width]
            stage.table = (self._version, end, n, width)
        if self.on_host and not self.sent:
            input_ids, positions, slots, cu, q_t, ctx_t, lens_t, table_t = stage.views(num_tokens, n, width)
        else:
            staged = stage.tensor[: end + n * width]
            staged = staged.to(self.device) if not self.on_host else staged.clone()
            input_ids, positions, slots, cu, q_t, ctx_t, lens_t, table_t = _split(staged, num_tokens, n, width)
        meta = AttentionMetadata(
            num_tokens=num_tokens, positions=positions, slot_mapping=slots, query_start_loc=cu, query_lens=q_t,
            context_lens=ctx_t, seq_lens=lens_t, block_tables=table_t,
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, context_lens_cpu=list(context_lens),
            max_query_len=max_query_len, max_seq_len=max(seq_lens))
        return input_ids, meta

    def _stage(self, size: int) -> Staging:
        """The next staging buffer of the ring, of ``size`` elements at least."""
        self._turn = (self._turn + 1) % len(self._staging)
        if self._staging[self._turn].array.shape[0] < size:
            self._staging[self._turn] = Staging(max(size, 2 * self._staging[self._turn].array.shape[0]))
        return self._staging[self._turn]


class Staging:
    """One buffer of a step's int64 values, back to back: input ids, positions, slots [T] each,
    query_start_loc [n + 1], query_lens, context_lens, seq_lens [n] each, block tables [n, width]."""

    def __init__(self, size: int) -> None:
        self.array = np.zeros(size, dtype=np.int64)
        # A normal tensor even when a step (in inference mode) grows the buffer: the compiled
        # forward's guards include its inputs' dispatch keys, and an inference tensor's differ
        # from the buffers' made at start-up, so the first step past their size recompiled.
        with torch.inference_mode(False):
            self.tensor = torch.from_numpy(self.array)
        self._layout: tuple[int, int, int] | None = None
        self.table: tuple[int, int, int, int] | None = None  # (InputBatch._version, offset, n, width) staged
        self._views: tuple[torch.Tensor, ...] = ()

    def views(self, num_tokens: int, n: int, width: int) -> tuple[torch.Tensor, ...]:
        """The step's tensors as views of the buffer; the last ones again for the same layout
        (every step of a steady decode): no tensor made."""
        if self._layout != (num_tokens, n, width):
            self._layout = (num_tokens, n, width)
            self._views = _split(self.tensor, num_tokens, n, width)
        return self._views


def _split(staged: torch.Tensor, num_tokens: int, n: int, width: int) -> tuple[torch.Tensor, ...]:
    parts = staged[: 3 * num_tokens + 4 * n + 1 + n * width].split(
        [num_tokens, num_tokens, num_tokens, n + 1, n, n, n, n * width])
    return (*parts[:7], parts[7].view(n, width))
