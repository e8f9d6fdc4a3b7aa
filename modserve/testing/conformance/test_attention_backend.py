"""AttentionBackend: causal attention over a paged KV cache, against a float64 reference.

Each case runs three steps of ragged batches mixing fresh prefills, chunked prefills (cached
context plus several new tokens) and decodes, over random block tables, with sequences
crossing block boundaries (:mod:`.attention_steps`). A backend that declares CUDA-graph
capture of decodes is also run the way a replayed graph runs it, on CPU.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from modserve.api import AttentionBackend, AttentionMetadata, CudaGraphSupport, op_by_name
from modserve.testing.conformance.attention_steps import AttentionCase, History, Step
from modserve.testing.conformance.targets import Implementation

CONFORMANCE_KIND = "attention_backend"
pytestmark = pytest.mark.usefixtures("modserve_one_thread")

F32, BF16 = torch.float32, torch.bfloat16
# Every head layout, head size (64, 128), block size (16, 8) and dtype, without the full product.
CASES = [
    AttentionCase(4, 4, 64, 16, F32),
    AttentionCase(4, 2, 128, 16, F32),
    AttentionCase(4, 1, 64, 8, F32),
    AttentionCase(4, 2, 64, 8, BF16),
    AttentionCase(2, 2, 128, 16, BF16),
    AttentionCase(4, 1, 128, 8, BF16),
    AttentionCase(4, 2, 64, 16, F32, fp8_kv=True),
    AttentionCase(4, 1, 128, 8, BF16, fp8_kv=True),
]
ATOL = {F32: 2e-5, BF16: 5e-2}  # against float64; bfloat16 keeps 8 bits of mantissa


def backend_for(implementation: Implementation, case: AttentionCase) -> AttentionBackend:
    backend = implementation.create(case.spec())
    problem = backend.kv_cache_problem()
    if problem is not None:
        what = "an fp8 (float8_e4m3fn) KV cache" if case.fp8_kv else f"a {case.dtype} KV cache"
        pytest.skip(f"{implementation} does not support {what}: {problem}")
    return backend


def run_steps(backend: AttentionBackend, history: History) -> Iterator[tuple[Step, torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]]:
    """(step, output, cache before, cache after) for each step, on one cache."""
    shape = tuple(backend.kv_cache_shape(history.num_blocks))
    cache = history.stale_cache(shape)
    for index in range(history.num_steps):
        step = history.step(index)
        before = cache.clone()
        out = backend.forward(step.q, step.k, step.v, cache, step.meta, backend.prepare(step.meta))
        assert tuple(cache.shape) == shape, f"forward changed the cache's shape to {tuple(cache.shape)}"
        yield step, out, before, cache


def worst_sequence(step: Step, error: torch.Tensor) -> tuple[int, float]:
    """(batch entry, error) of the sequence whose rows are furthest from the reference."""
    per_row = error.flatten(1).amax(dim=1)  # [T]
    starts = step.meta.query_start_loc.tolist()
    worst = [float(per_row[a:b].max()) for a, b in zip(starts, starts[1:])]
    i = max(range(len(worst)), key=worst.__getitem__)
    return i, worst[i]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_float64_reference(implementation: Implementation, case: AttentionCase) -> None:
    """Every query row attends causally to its own sequence's keys (cached context and this
    step's, GQA heads sharing KV heads), within float error of the reference; output
    ``[T, H, D]`` in the compute dtype. An fp8 cache is read as stored, this step's keys included."""
    backend = backend_for(implementation, case)
    history = History(case, seed=case.head_dim + case.block_size)
    for step, out, _, _ in run_steps(backend, history):
        assert isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(step.q.shape), (
            f"step {step.index}: the output must be [T, H, D] = {tuple(step.q.shape)}, "
            f"got {getattr(out, 'shape', type(out).__name__)}")
        assert out.dtype == case.dtype, f"step {step.index}: the output must be {case.dtype}, got {out.dtype}"
        error = (out.double() - history.reference(step)).abs()
        i, worst = worst_sequence(step, error)
        assert worst <= ATOL[case.dtype], (
            f"step {step.index}: {step.describe(i)} differs from causal attention over its cached and new keys "
            f"by {worst:.3g} (tolerance {ATOL[case.dtype]:g}); every row must attend exactly to its sequence's "
            f"positions <= its own")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_writes_kv_into_its_blocks_only(implementation: Implementation, case: AttentionCase) -> None:
    """``forward`` stores this step's keys and values in the blocks ``meta.slot_mapping`` names,
    dimension 1 of the cache being the block index, and changes no other block."""
    backend = backend_for(implementation, case)
    history = History(case, seed=case.head_dim + case.block_size + 1)
    for step, _, before, after in run_steps(backend, history):
        written = history.written(step)
        for block in range(history.num_blocks):
            if block not in written:
                assert torch.equal(after[:, block].view(torch.uint8), before[:, block].view(torch.uint8)), (
                    f"step {step.index}: block {block} changed, but meta.slot_mapping writes nothing there"
                    + (" (a block in no block table)" if block in history.spare else ""))
            elif case.dtype == torch.float32 and not case.fp8_kv:  # distinct float32 values: a fingerprint
                missing = ~torch.isin(written[block], after[:, block].flatten())
                assert not missing.any(), (
                    f"step {step.index}: {int(missing.sum())} of the {written[block].numel()} key/value numbers "
                    f"meta.slot_mapping puts in block {block} are not in kv_cache[:, {block}] (dimension 1 of "
                    f"kv_cache_shape() must be the block index)")


def test_kv_cache_shape_indexes_blocks_in_dimension_1(implementation: Implementation) -> None:
    """Block copies (copy-on-write) and swaps move ``kv_cache[:, block]``: only dimension 1 may
    depend on the number of blocks."""
    backend = implementation.create(CASES[1].spec())
    small, large = tuple(backend.kv_cache_shape(5)), tuple(backend.kv_cache_shape(9))
    assert len(small) >= 2 and small[1] == 5 and large[1] == 9, (
        f"kv_cache_shape(5) = {small}, kv_cache_shape(9) = {large}: dimension 1 must be the block count")
    assert small[:1] + small[2:] == large[:1] + large[2:], (
        f"kv_cache_shape(5) = {small}, kv_cache_shape(9) = {large}: only dimension 1 may change with it")


def _as_captured(meta: AttentionMetadata, max_model_len: int, block_size: int, padding: int) -> AttentionMetadata:
    """``meta`` (decodes only) as a CUDA graph captured for ``num_seqs + padding`` rows sees it:
    the step's values in its tensors, ``padding`` rows that write nowhere (slot -1) and read one
    key of block 0, block tables as wide as ``max_model_len``, and host lists holding that worst
    case, not the step's."""
    b, rows, cols = meta.num_seqs, meta.num_seqs + padding, meta.block_tables.shape[1]
    tables = torch.zeros(rows, -(-max_model_len // block_size), dtype=meta.block_tables.dtype)
    tables[:b, :cols] = meta.block_tables

    def padded(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((padding,), value, dtype=t.dtype)])

    return AttentionMetadata(
        num_tokens=rows, positions=padded(meta.positions, 0), slot_mapping=padded(meta.slot_mapping, -1),
        query_start_loc=torch.arange(rows + 1, dtype=meta.query_start_loc.dtype),
        query_lens=torch.ones(rows, dtype=meta.query_lens.dtype), context_lens=padded(meta.context_lens, 0),
        seq_lens=padded(meta.seq_lens, 1), block_tables=tables, query_lens_cpu=[1] * rows,
        seq_lens_cpu=[max_model_len] * rows, context_lens_cpu=[max_model_len - 1] * rows, max_query_len=1,
        max_seq_len=max_model_len)


@pytest.mark.parametrize("case", CASES[:3] + CASES[6:7], ids=lambda c: c.id)
def test_keeps_its_cuda_graph_promise(implementation: Implementation, case: AttentionCase) -> None:
    """``cuda_graphs = DECODE``: a step of decodes gives the same attention when its host lists
    hold only the worst case (a graph replays what was captured with them), padding rows with
    slot -1 change no block, and the padding's output is finite."""
    backend = backend_for(implementation, case)
    if type(backend).cuda_graphs is not CudaGraphSupport.DECODE:
        pytest.skip(f"{implementation} declares no CUDA-graph capture (cuda_graphs: "
                    f"{type(backend).cuda_graphs.value})")
    history = History(case, seed=case.head_dim + case.block_size + 2)
    steps = run_steps(backend, history)
    for _ in range(history.num_steps - 1):  # the cache holds every sequence's first steps
        _, _, _, cache = next(steps)
    step = history.decode_step(history.num_steps - 1)
    max_model_len = 8 * case.block_size * (1 + max(len(t) for t in history.tables))
    meta = _as_captured(step.meta, max_model_len, case.block_size, padding=3)
    b = step.meta.num_seqs

    def padded(x: torch.Tensor) -> torch.Tensor:  # [B, heads, D] -> [B + 3, heads, D]
        return torch.cat([x, torch.randn(3, *x.shape[1:], generator=history.gen).to(x.dtype)])

    before = cache.clone()
    pk, pv = padded(step.k), padded(step.v)
    out = backend.forward(padded(step.q), pk, pv, cache, meta, backend.prepare(meta))
    error = (out[:b].double() - history.reference(step)).abs()
    i, worst = worst_sequence(step, error)
    assert worst <= ATOL[case.dtype], (
        f"{step.describe(i)} differs from causal attention by {worst:.3g} when the step's host lists hold the "
        f"worst case (max_seq_len {max_model_len}): with cuda_graphs = DECODE, prepare() and forward() must take "
        f"each sequence's length from meta's tensors, never from seq_lens_cpu / context_lens_cpu")
    assert torch.isfinite(out[b:]).all(), "padding rows (slot -1, seq_len 1) must give finite output"
    if case.dtype == torch.float32 and not case.fp8_kv:  # distinct float32 values: a fingerprint
        padding = torch.cat([pk[b:].flatten(), pv[b:].flatten()])
        stray = torch.isin(padding, cache.flatten()) & ~torch.isin(padding, before.flatten())  # stale: no news
        assert not stray.any(), (f"{int(stray.sum())} key/value numbers of the padding rows are in the cache: a "
                                 f"slot of -1 in meta.slot_mapping (a graph's padding row) must write nowhere")
    written = history.written(step)
    for block in range(history.num_blocks):
        if block not in written:
            assert torch.equal(cache[:, block].view(torch.uint8), before[:, block].view(torch.uint8)), (
                f"block {block} changed: a slot of -1 in meta.slot_mapping (a graph's padding row) must write "
                f"nowhere")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_native_decode_op_does_forwards_work(implementation: Implementation, case: AttentionCase) -> None:
    """``native_decode()``: the op it names, on a step of decodes without ``prepare``, writes the
    step's keys and values where ``forward`` does and returns causal attention over them."""
    backend = backend_for(implementation, case)
    name = backend.native_decode()
    if name is None:
        pytest.skip(f"{implementation} names no native decode op for this case")
    op = op_by_name(name)
    history = History(case, seed=case.head_dim + case.block_size + 3)
    steps = run_steps(backend, history)
    for _ in range(history.num_steps - 1):  # the cache holds every sequence's first steps
        _, _, _, cache = next(steps)
    step = history.decode_step(history.num_steps - 1)
    by_forward = cache.clone()
    backend.forward(step.q, step.k, step.v, by_forward, step.meta, backend.prepare(step.meta))
    m = step.meta
    out = op(step.q, step.k, step.v, cache, m.slot_mapping, m.block_tables, m.seq_lens, backend.spec.scale)
    assert isinstance(out, torch.Tensor) and out.shape == step.q.shape and out.dtype == case.dtype, (
        f"{name} must return [T, H, D] = {tuple(step.q.shape)} {case.dtype}, got {getattr(out, 'shape', out)}")
    error = (out.double() - history.reference(step)).abs()
    i, worst = worst_sequence(step, error)
    assert worst <= ATOL[case.dtype], (
        f"{name}: {step.describe(i)} differs from causal attention by {worst:.3g} (tolerance {ATOL[case.dtype]:g})")
    assert torch.equal(cache.view(torch.uint8), by_forward.view(torch.uint8)), (
        f"{name} left the cache other than forward() does: it must write the step's k and v at meta.slot_mapping "
        f"exactly as forward() stores them")
