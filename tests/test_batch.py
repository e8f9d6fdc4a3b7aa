"""A step's batch: small decode steps, built from Python lists, get exactly what the numpy
path for any chunk lengths builds."""

from __future__ import annotations

import random

import pytest
import torch

from modserve.runner import batch
from modserve.runner.batch import SMALL_DECODE_STEP, build_batch

FIELDS = ("positions", "slot_mapping", "query_start_loc", "query_lens", "context_lens", "seq_lens", "block_tables",
          "query_lens_cpu", "seq_lens_cpu", "context_lens_cpu", "num_tokens", "max_query_len", "max_seq_len")


@pytest.mark.parametrize("n", [1, 2, 5, SMALL_DECODE_STEP])
def test_a_decode_batch_is_the_varlen_batch(n, monkeypatch):
    rng = random.Random(n)
    block_size = 16
    for _ in range(20):
        context = [rng.randrange(0, 300) for _ in range(n)]
        # each sequence's blocks, some with spare blocks past its last token, in any order
        tables = [rng.sample(range(1000), (c // block_size) + 1 + rng.randrange(3)) for c in context]
        chunks = [[rng.randrange(8000)] for _ in range(n)]
        args = (chunks, context, tables, block_size, torch.device("cpu"))
        ids, meta = build_batch(*args)
        with monkeypatch.context() as m:
            m.setattr(batch, "SMALL_DECODE_STEP", 0)  # every step through numpy
            ref_ids, ref = build_batch(*args)
        assert torch.equal(ids, ref_ids)
        for name in FIELDS:
            got, want = getattr(meta, name), getattr(ref, name)
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got, want), name
            else:
                assert got == want, name


def test_a_step_with_a_sequence_without_tokens_is_not_a_decode_step():
    ids, meta = build_batch([[5], [], [6]], [3, 8, 20], [[1], [2], [4, 9]], 16, torch.device("cpu"))
    assert ids.tolist() == [5, 6] and meta.positions.tolist() == [3, 20] and meta.query_lens.tolist() == [1, 0, 1]
    assert meta.slot_mapping.tolist() == [16 + 3, 9 * 16 + 4] and meta.query_start_loc.tolist() == [0, 1, 1, 2]


def test_a_mixed_step_is_built_as_before():
    """A prefill chunk of 3 beside a decode: rows, positions and slots across block edges."""
    ids, meta = build_batch([[5, 6, 7], [9]], [14, 31], [[4, 2], [7, 3]], 16, torch.device("cpu"))
    assert ids.tolist() == [5, 6, 7, 9]
    assert meta.positions.tolist() == [14, 15, 16, 31]
    assert meta.slot_mapping.tolist() == [4 * 16 + 14, 4 * 16 + 15, 2 * 16 + 0, 3 * 16 + 15]
    assert meta.query_start_loc.tolist() == [0, 3, 4] and meta.seq_lens.tolist() == [17, 32]
    assert meta.block_tables.tolist() == [[4, 2], [7, 3]] and meta.max_query_len == 3 and meta.max_seq_len == 32
