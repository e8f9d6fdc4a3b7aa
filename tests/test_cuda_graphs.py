"""CUDA graphs for decode steps, on CPU: which sizes, which steps replay, the static buffers
and their padding, the downgrades, and greedy tokens through a real engine.

A graph is stood in for by :class:`RerunRecorder`: its replay runs the captured forward
again on the same static buffers and the same static metadata, so like a real graph it sees
the values copied into the buffers and only the host lists of capture time.
"""

from __future__ import annotations

import logging
import types
from typing import Any, Callable

import pytest
import torch

from modserve import LLM, SamplingParams
from modserve.api import AttentionBackend, AttentionMetadata, AttentionSpec, CudaGraphSupport, GraphSettings
from modserve.attention_backends.paged import PagedAttention
from modserve.attention_backends.reference import ReferenceAttention
from modserve.runner.batch import build_batch
from modserve.core.hookspecs import hookimpl
from modserve.core.registry import get_registry
from modserve.plugins.platforms.cuda.graphs import (CudaGraphRecorder, DecodeGraphs, Recorder, capture_decode_graphs,
                                                    capture_sizes, default_sizes, graph_plan)

BLOCK_SIZE = 4
MAX_MODEL_LEN = 32
WIDTH = MAX_MODEL_LEN // BLOCK_SIZE  # the static block table's columns
CPU = torch.device("cpu")


class RerunRecorder(Recorder):
    """A graph's stand-in: the replay calls the captured fn again, on the same static tensors."""

    def __init__(self) -> None:
        self.inference_mode: list[bool] = []  # per capture: under torch.inference_mode()

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        self.inference_mode.append(torch.is_inference_mode_enabled())
        fn()  # the capture run
        return fn


class FailingRecorder(Recorder):
    """A capture that raises, as one of an op that syncs with the host does."""

    def __init__(self) -> None:
        self.released = False

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        raise RuntimeError("operation not permitted when stream is capturing")

    def release(self) -> None:
        self.released = True


def settings(sizes: tuple[int, ...] | None = None, max_num_seqs: int = 8) -> GraphSettings:
    return GraphSettings(sizes, "test", max_num_seqs, MAX_MODEL_LEN, BLOCK_SIZE)


def step(seq_lens: list[int], query_lens: list[int] | None = None) -> tuple[torch.Tensor, AttentionMetadata]:
    """A step of sequences ``i`` of ``seq_lens[i]`` tokens computing their last ``query_lens[i]``
    (1: a decode), each on blocks of its own (numbered from 1: block 0 is the padding's)."""
    query_lens = query_lens or [1] * len(seq_lens)
    chunks = [[100 * i + j for j in range(q)] for i, q in enumerate(query_lens)]
    tables, next_block = [], 1
    for n in seq_lens:
        count = -(-n // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    return build_batch(chunks, [s - q for s, q in zip(seq_lens, query_lens)], tables, BLOCK_SIZE, CPU)


def blocks_read(meta: AttentionMetadata) -> torch.Tensor:  # [B]
    """A checksum of the block ids a kernel reads: those below seq_len, weighted by column."""
    cols = torch.arange(meta.block_tables.shape[1])
    read = cols[None, :] * BLOCK_SIZE < meta.seq_lens[:, None]  # [B, W]
    return ((cols + 1) * meta.block_tables * read).sum(1)


class RecordingForward:
    """A forward whose hidden row t tells what it read for token t; it keeps a copy of every call."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [T, 6]
        self.calls.append({"meta": meta, "input_ids": input_ids.clone(), "positions": meta.positions.clone(),
                           "slot_mapping": meta.slot_mapping.clone(), "context_lens": meta.context_lens.clone(),
                           "seq_lens": meta.seq_lens.clone(), "block_tables": meta.block_tables.clone()})
        seq_of_row = torch.repeat_interleave(torch.arange(meta.query_lens.shape[0]), meta.query_lens)  # [T]
        return torch.stack([input_ids, meta.positions, meta.slot_mapping, meta.context_lens[seq_of_row],
                            meta.seq_lens[seq_of_row], blocks_read(meta)[seq_of_row]], dim=1).float()


def graphs_of(forward: Callable, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> DecodeGraphs:
    return DecodeGraphs(forward, list(sizes), settings(sizes), CPU, RerunRecorder())


def spec() -> AttentionSpec:
    return AttentionSpec(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, scale=0.5,
                         block_size=BLOCK_SIZE, dtype=torch.float32, device=CPU)


class DecodeAttention(ReferenceAttention):
    cuda_graphs = CudaGraphSupport.DECODE


# -- sizes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_num_seqs, expected", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 24]),
    (256, [1, 2, 4] + list(range(8, 257, 8)))])
def test_default_sizes_cover_every_batch_up_to_max_num_seqs(max_num_seqs, expected):
    assert default_sizes(max_num_seqs) == expected
    assert capture_sizes(settings(None, max_num_seqs)) == expected


def test_given_sizes_sorted_deduplicated_and_capped(caplog):
    with caplog.at_level(logging.INFO, logger="modserve"):
        assert capture_sizes(settings((16, 4, 64, 4, 1, 48), max_num_seqs=32)) == [1, 4, 16]
    assert "sizes [48, 64] dropped (above max_num_seqs 32)" in caplog.text


def test_a_size_below_one_is_refused():
    with pytest.raises(ValueError, match=r"positive batch sizes, not \[0\]"):
        capture_sizes(settings((0, 2)))


def test_plan_captures_what_a_decode_backend_allows():
    assert graph_plan(settings((4, 2)), DecodeAttention(spec())) == ([2, 4], None)


# -- replay: buffers, padding, sizes -----------------------------------------------------------------
def test_decode_step_replays_the_next_size_with_padding():
    forward = RecordingForward()
    graphs = graphs_of(forward)
    assert graphs.sizes == [1, 2, 4, 8] and len(forward.calls) == 4  # the capture runs
    ids, meta = step([5, 9, 13])  # B = 3: size 4, one padding row
    out = graphs(ids, meta)
    assert graphs.replays == {4: 1} and graphs.eager_steps == 0
    seen = forward.calls[-1]
    assert seen["meta"] is graphs.metas[4]
    for name in ("positions", "slot_mapping", "context_lens", "seq_lens"):
        assert seen[name][:3].tolist() == getattr(meta, name).tolist(), name
    assert seen["input_ids"][:3].tolist() == ids.tolist()
    assert seen["block_tables"].shape == (4, WIDTH)
    assert seen["block_tables"][:3, : meta.block_tables.shape[1]].tolist() == meta.block_tables.tolist()
    # The padding row writes nowhere and reads one key of block 0.
    assert [seen[n][3].item() for n in ("input_ids", "positions", "slot_mapping", "context_lens", "seq_lens")] \
        == [0, 0, -1, 0, 1]
    assert seen["block_tables"][3].tolist() == [0] * WIDTH
    # Only the step's rows come back, as the eager forward computes them.
    assert out.shape == (3, 6)
    assert torch.equal(out, RecordingForward()(ids, meta))


@pytest.mark.parametrize("batch, size", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (7, 8), (8, 8)])
def test_each_batch_replays_the_smallest_size_that_holds_it(batch, size):
    forward = RecordingForward()
    graphs = graphs_of(forward)
    ids, meta = step([3 + i for i in range(batch)])
    assert torch.equal(graphs(ids, meta), RecordingForward()(ids, meta))
    assert graphs.replays == {size: 1}


def test_rows_a_larger_step_filled_are_padding_again():
    forward = RecordingForward()
    graphs = graphs_of(forward)
    graphs(*step([9, 10, 11, 12, 13, 14, 15]))  # size 8: rows 0..6 hold this step
    ids, meta = step([21, 22, 23])  # size 4: row 3 must be padding again, not row 3 of the last step
    out = graphs(ids, meta)
    seen = forward.calls[-1]
    assert [seen[n][3].item() for n in ("input_ids", "positions", "slot_mapping", "context_lens", "seq_lens")] \
        == [0, 0, -1, 0, 1]
    assert seen["block_tables"][3].tolist() == [0] * WIDTH
    assert torch.equal(out, RecordingForward()(ids, meta))
    ids, meta = step([4, 5, 6, 7, 8])  # size 8 again: rows 5..7 padding (6 still held the first step's)
    graphs(ids, meta)
    seen = forward.calls[-1]
    assert seen["slot_mapping"][5:].tolist() == [-1] * 3 and seen["seq_lens"][5:].tolist() == [1] * 3
    assert seen["block_tables"][5:].tolist() == [[0] * WIDTH] * 3


def test_a_narrower_block_table_keeps_what_a_kernel_reads_right():
    forward = RecordingForward()
    graphs = graphs_of(forward)
    graphs(*step([30, 31]))  # 8 blocks each
    ids, meta = step([2, 6])  # 2 columns: the stale columns past them are not read
    assert meta.block_tables.shape[1] == 2
    assert torch.equal(graphs(ids, meta), RecordingForward()(ids, meta))


# -- what runs eagerly -----------------------------------------------------------------------------
@pytest.mark.parametrize("seq_lens, query_lens", [
    ([6, 7], [6, 7]),  # prefills
    ([6, 9, 4], [6, 1, 1]),  # a prefill beside decodes
    ([6, 9], [3, 3]),  # speculative: a token and two drafts each
    ([6, 9, 4], [1, 0, 1]),  # a sequence with no new token this step
    ([3] * 9, None),  # more sequences than the largest size
], ids=["prefill", "mixed", "speculative", "no-token", "above-largest"])
def test_other_steps_run_eagerly_with_their_own_metadata(seq_lens, query_lens):
    forward = RecordingForward()
    graphs = graphs_of(forward)
    ids, meta = step(seq_lens, query_lens)
    out = graphs(ids, meta)
    assert forward.calls[-1]["meta"] is meta
    assert graphs.eager_steps == 1 and not graphs.replays
    assert torch.equal(out, RecordingForward()(ids, meta))


def test_capture_runs_largest_first_under_inference_mode():
    forward, recorder = RecordingForward(), RerunRecorder()
    DecodeGraphs(forward, [2, 1, 8, 4], settings(), CPU, recorder)
    assert [c["input_ids"].shape[0] for c in forward.calls] == [8, 4, 2, 1]
    assert recorder.inference_mode == [True] * 4
    # At capture the buffers hold the padding, the host lists the worst case.
    first = forward.calls[0]
    assert first["slot_mapping"].tolist() == [-1] * 8 and first["seq_lens"].tolist() == [1] * 8
    meta = first["meta"]
    assert meta.seq_lens_cpu == [MAX_MODEL_LEN] * 8 and meta.context_lens_cpu == [MAX_MODEL_LEN - 1] * 8
    assert meta.query_lens_cpu == [1] * 8 and (meta.max_query_len, meta.max_seq_len) == (1, MAX_MODEL_LEN)
    assert meta.query_start_loc.tolist() == list(range(9))


# -- downgrades ------------------------------------------------------------------------------------
def test_no_sizes_means_eager(caplog):
    forward = RecordingForward()
    with caplog.at_level(logging.INFO, logger="modserve"):
        assert capture_decode_graphs(forward, DecodeAttention(spec()), settings(()), CPU, RerunRecorder()) is forward
    assert "cuda graphs: off (cuda_graph_sizes: [] / enforce_eager)" in caplog.text
    assert not forward.calls


@pytest.mark.parametrize("backend", [ReferenceAttention, PagedAttention])
def test_a_backend_that_cannot_be_captured_means_eager(backend: type[AttentionBackend], caplog):
    assert backend.cuda_graphs is CudaGraphSupport.NEVER
    forward = RecordingForward()
    with caplog.at_level(logging.INFO, logger="modserve"):
        assert capture_decode_graphs(forward, backend(spec()), settings(), CPU, RerunRecorder()) is forward
    assert ("cuda graphs: off (attention backend 'test' cannot be captured (cuda_graphs: never); "
            "the triton backend can)") in caplog.text
    assert not forward.calls


def test_sizes_all_above_max_num_seqs_means_eager(caplog):
    forward = RecordingForward()
    with caplog.at_level(logging.INFO, logger="modserve"):
        assert capture_decode_graphs(forward, DecodeAttention(spec()), settings((16,), max_num_seqs=8), CPU,
                                     RerunRecorder()) is forward
    assert "cuda graphs: off (no cuda_graph_sizes within max_num_seqs 8)" in caplog.text


def test_a_failed_capture_means_eager_with_a_warning(caplog):
    forward, recorder = RecordingForward(), FailingRecorder()
    with caplog.at_level(logging.WARNING, logger="modserve"):
        assert capture_decode_graphs(forward, DecodeAttention(spec()), settings(), CPU, recorder) is forward
    assert ("cuda graphs: off (capturing decode batch size 8 failed: RuntimeError: operation not permitted when "
            "stream is capturing); every step runs eagerly") in caplog.text
    assert recorder.released
    graphs = DecodeGraphs(forward, [1, 2], settings(), CPU, FailingRecorder())  # used anyway: all eager
    ids, meta = step([5])
    assert torch.equal(graphs(ids, meta), RecordingForward()(ids, meta)) and graphs.eager_steps == 1


def test_graphs_log_what_they_captured(caplog):
    with caplog.at_level(logging.INFO, logger="modserve"):
        graphs = capture_decode_graphs(RecordingForward(), DecodeAttention(spec()), settings((1, 4)), CPU,
                                       RerunRecorder())
    assert isinstance(graphs, DecodeGraphs)
    assert "cuda graphs: decode batch sizes [1, 4] captured in" in caplog.text


# -- the double catches a backend that breaks the promise ----------------------------------------------
def test_a_forward_reading_host_lists_is_wrong_under_replay():
    def reads_device(input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [T, 1]
        return meta.seq_lens[:, None].float()

    def reads_host(input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [T, 1]
        return torch.tensor(meta.seq_lens_cpu, dtype=torch.float32)[:, None]

    ids, meta = step([5, 9, 13])
    assert torch.equal(graphs_of(reads_device)(ids, meta), reads_device(ids, meta))
    assert torch.equal(reads_host(ids, meta), reads_device(ids, meta))  # eagerly the two agree
    replayed = graphs_of(reads_host)(ids, meta)
    assert replayed[:, 0].tolist() == [MAX_MODEL_LEN] * 3  # the capture's host values, not the step's


# -- end to end: greedy tokens through a real engine --------------------------------------------------
class GraphSafeAttention(ReferenceAttention):
    """Decodes the way the DECODE promise asks of their data: from ``meta``'s tensors only, a slot
    of -1 writing nowhere (prefills: the reference's way). NOTE: its boolean masks would sync on a
    GPU: a CPU stand-in for a capturable backend, not one."""

    cuda_graphs = CudaGraphSupport.DECODE

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, state: Any) -> torch.Tensor:  # [B, H, D]
        if meta.max_query_len != 1:
            return super().forward(q, k, v, kv_cache, meta, state)
        s = self.spec
        key_cache = kv_cache[0].view(-1, s.num_kv_heads, s.head_dim)  # [slots, Hkv, D]
        value_cache = kv_cache[1].view(-1, s.num_kv_heads, s.head_dim)
        keep = meta.slot_mapping >= 0  # [B]
        key_cache[meta.slot_mapping[keep]] = k[keep]
        value_cache[meta.slot_mapping[keep]] = v[keep]
        pos = torch.arange(meta.block_tables.shape[1] * s.block_size)  # [L]
        at = meta.block_tables[:, pos // s.block_size] * s.block_size + pos % s.block_size  # [B, L]
        group = s.num_heads // s.num_kv_heads
        keys = key_cache[at].repeat_interleave(group, dim=2)  # [B, L, H, D]
        values = value_cache[at].repeat_interleave(group, dim=2)
        scores = torch.einsum("bhd,blhd->bhl", q, keys) * s.scale  # [B, H, L]
        scores = scores.masked_fill(pos[None, None, :] >= meta.seq_lens[:, None, None], float("-inf"))
        return torch.einsum("bhl,blhd->bhd", scores.softmax(-1), values)


PROMPTS = ["The quick brown fox", "Hello", "one two three four five six", "a b c", "model token cache"]


def recording(forward: Callable, into: list[torch.Tensor]) -> Callable:
    def run(input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        into.append(forward(input_ids, meta).clone())
        return into[-1]
    return run


@pytest.mark.parametrize("backend", ["graph-safe", "triton"])
def test_greedy_tokens_equal_the_eager_engine(llama_dir, backend):
    reg = get_registry()
    reg.add_plugin(types.SimpleNamespace(register_attention_backends=hookimpl(
        lambda register: register("graph-safe", GraphSafeAttention))), "test-graph-safe")  # fresh_registry forgets it
    if backend not in reg.names("attention_backend"):
        pytest.skip(f"attention backend {backend!r} is not registered (not written yet)")
    llm = LLM(llama_dir, attention_backend=backend, dtype="float32", num_kv_blocks=64, block_size=4,
              max_model_len=64, max_num_seqs=8, progress=False)
    runner = llm.engine.runner
    assert runner.attn.cuda_graphs is CudaGraphSupport.DECODE
    # max_tokens 4..8: the batch shrinks 5, 4, 3, 2, 1 as requests finish, so most sizes pad.
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    cfg = GraphSettings(None, "test", 8, runner.max_model_len, runner.block_size)
    graphs = DecodeGraphs(runner._forward, capture_sizes(cfg), cfg, runner.device, RerunRecorder())
    # Graphs first, on a fresh allocator: block 0, which the padding rows read, is the first prompt's.
    replayed_hidden: list[torch.Tensor] = []
    runner.step_forward = recording(graphs, replayed_hidden)
    replayed = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    eager_hidden: list[torch.Tensor] = []
    runner.step_forward = recording(runner._forward, eager_hidden)
    llm.reset_prefix_cache()  # prompts computed again: the same steps
    eager = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert replayed == eager
    assert len(replayed_hidden) == len(eager_hidden)
    for i, (r, e) in enumerate(zip(replayed_hidden, eager_hidden)):
        torch.testing.assert_close(r, e, msg=lambda m: f"step {i}: {m}")
    assert {8, 4, 2, 1} <= set(graphs.replays) and graphs.eager_steps >= 1  # 5 and 3 pad; prefills eager


# -- on a GPU (skipped elsewhere): the real recorder ------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_cuda_recorder_replays_on_new_values():
    x = torch.zeros(4, device="cuda")
    recorder = CudaGraphRecorder(torch.device("cuda"))
    replay = recorder.capture(lambda: x * 2 + 1)
    x.copy_(torch.arange(4.0))
    assert replay().tolist() == [1.0, 3.0, 5.0, 7.0]
    assert "graph memory:" in recorder.summary()


@needs_cuda
def test_cuda_graphs_keep_greedy_tokens(llama_dir, caplog):
    if "triton" not in get_registry().names("attention_backend"):
        pytest.skip("attention backend 'triton' is not registered")
    kw = dict(device="cuda", attention_backend="triton", dtype="float32", num_kv_blocks=256, max_num_seqs=8,
              progress=False)
    with caplog.at_level(logging.INFO, logger="modserve"):
        graphed = LLM(llama_dir, **kw)
    assert "cuda graphs: decode batch sizes [1, 2, 4, 8] captured in" in caplog.text
    graphs = graphed.engine.runner.step_forward
    assert isinstance(graphs, DecodeGraphs)
    eager = LLM(llama_dir, cuda_graph_sizes=[], **kw)
    assert not isinstance(eager.engine.runner.step_forward, DecodeGraphs)
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    assert ([o.outputs[0].token_ids for o in graphed.generate(PROMPTS, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params, use_tqdm=False)])
    assert {8, 4, 2, 1} <= set(graphs.replays)
