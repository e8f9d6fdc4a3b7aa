"""A step's batch: the Python-list path for small decode steps builds exactly what the
numpy path builds."""

from __future__ import annotations

import random

import pytest
import torch

from modserve.core.batch import SMALL_DECODE_STEP, build_batch, decode_batch, varlen_batch

FIELDS = ("positions", "slot_mapping", "query_start_loc", "query_lens", "context_lens", "seq_lens", "block_tables",
          "query_lens_cpu", "seq_lens_cpu", "context_lens_cpu", "num_tokens", "max_query_len", "max_seq_len")


@pytest.mark.parametrize("n", [1, 2, 5, SMALL_DECODE_STEP])
def test_a_decode_batch_is_the_varlen_batch(n):
    rng = random.Random(n)
    block_size = 16
    for _ in range(20):
        context = [rng.randrange(0, 300) for _ in range(n)]
        # each sequence's blocks, some with spare blocks past its last token, in any order
        tables = [rng.sample(range(1000), (c // block_size) + 1 + rng.randrange(3)) for c in context]
        chunks = [[rng.randrange(8000)] for _ in range(n)]
        args = (chunks, context, tables, block_size, torch.device("cpu"))
        ids, meta = decode_batch(*args)
        ref_ids, ref = varlen_batch(*args)
        assert torch.equal(ids, ref_ids)
        for name in FIELDS:
            got, want = getattr(meta, name), getattr(ref, name)
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got, want), name
            else:
                assert got == want, name


def test_build_batch_takes_the_decode_path_only_for_small_decode_steps(monkeypatch):
    calls = []
    monkeypatch.setattr("modserve.core.batch.decode_batch", lambda *a: calls.append(len(a[0])) or varlen_batch(*a))
    cpu = torch.device("cpu")
    build_batch([[1]] * 3, [5, 6, 7], [[0], [1], [2]], 16, cpu)
    build_batch([[1, 2], [3]], [5, 6], [[0], [1]], 16, cpu)  # a chunk of two: not a decode step
    build_batch([[1]] * (SMALL_DECODE_STEP + 1), [5] * (SMALL_DECODE_STEP + 1),
                [[i] for i in range(SMALL_DECODE_STEP + 1)], 16, cpu)
    assert calls == [3]
