"""CUDA graphs for decode steps: capture one graph per batch size, replay the next size up.

A decode step of a small model is mostly kernel launches (a few hundred per layer stack);
a graph replays them as one. The logic (which sizes, which steps fit, the static buffers
and their padding) is plain torch and runs on any device; only :class:`CudaGraphRecorder`
calls CUDA, behind the :class:`Recorder` seam that tests replace.

A graph replays the kernels it recorded on the tensors it recorded them on, so every step
it serves is copied into static buffers first, and the attention backend must keep the
``cuda_graphs = DECODE`` promise (:class:`~modserve.api.AttentionBackend`): the same work
whatever the values, nothing read from the host, slot -1 writes nowhere.
"""

from __future__ import annotations

import bisect
import collections
import logging
import time
from abc import ABC, abstractmethod
from typing import Callable, NamedTuple

import torch

from modserve.api import AttentionBackend, AttentionMetadata, CudaGraphSupport, GraphSettings, StepForward

logger = logging.getLogger("modserve")

Replay = Callable[[], torch.Tensor]  # runs the recorded step again; returns its (static) output


# ---------------------------------------------------------------------------
# What to capture
# ---------------------------------------------------------------------------
def default_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's buckets: 1, 2, 4, then every 8; the last one is the first at or above
    ``max_num_seqs``, so every decode batch the scheduler can form has a graph."""
    sizes = [1, 2, 4]
    while sizes[-1] < max_num_seqs:
        sizes.append(8 * (sizes[-1] // 8 + 1))
    return sizes[: bisect.bisect_left(sizes, max_num_seqs) + 1]


def capture_sizes(settings: GraphSettings) -> list[int]:
    """The batch sizes to capture, ascending: ``settings.sizes`` (deduplicated, those above
    ``max_num_seqs`` dropped: no batch reaches them), or the default buckets."""
    if settings.sizes is None:
        return default_sizes(settings.max_num_seqs)
    if bad := [s for s in settings.sizes if s <= 0]:
        raise ValueError(f"cuda_graph_sizes must be positive batch sizes, not {bad}")
    sizes = sorted(set(settings.sizes))
    if dropped := [s for s in sizes if s > settings.max_num_seqs]:
        logger.info("cuda graphs: sizes %s dropped (above max_num_seqs %d)", dropped, settings.max_num_seqs)
    return [s for s in sizes if s <= settings.max_num_seqs]


class GraphPlan(NamedTuple):
    sizes: list[int]  # ascending; empty: no graphs
    off_reason: str | None  # why there are none, for the log


def graph_plan(settings: GraphSettings, backend: AttentionBackend) -> GraphPlan:
    """What will be captured: no more than the backend declares (``cuda_graphs``)."""
    if settings.sizes == ():
        return GraphPlan([], "cuda_graph_sizes: [] / enforce_eager")
    support = backend.cuda_graphs
    if support is not CudaGraphSupport.DECODE:
        return GraphPlan([], f"attention backend {settings.attention_backend!r} cannot be captured "
                             f"(cuda_graphs: {support.value}); the triton backend can")
    sizes = capture_sizes(settings)
    if not sizes:
        return GraphPlan([], f"no cuda_graph_sizes within max_num_seqs {settings.max_num_seqs}")
    return GraphPlan(sizes, None)


# ---------------------------------------------------------------------------
# How to capture
# ---------------------------------------------------------------------------
class Recorder(ABC):
    """Turns a step's forward on static buffers into something that replays it.

    Contract: ``capture`` is called once per size, largest first; ``fn`` reads and writes only
    tensors that outlive the capture. The replay runs ``fn``'s work again on whatever those
    tensors hold then, and returns the same output tensor every time (overwritten)."""

    @abstractmethod
    def capture(self, fn: Replay) -> Replay: ...

    def summary(self) -> str:
        """What the captures cost, for the log line; empty when nothing is measured."""
        return ""

    def release(self) -> None:
        """Drop every capture (a later one failed): their memory goes back. Default: nothing."""


class CudaGraphRecorder(Recorder):
    """``torch.cuda.graph``, every size into one memory pool on one side stream: captured
    largest first, a smaller graph reuses the larger one's freed intermediates."""

    def __init__(self, device: torch.device, warmup_runs: int = 2) -> None:
        self.device = device
        self.warmup_runs = warmup_runs
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.pool: object | None = None  # graph_pool_handle(): an opaque token
        self.stream: torch.cuda.Stream | None = None
        self.memory_before = (0, 0)  # allocated, reserved

    def capture(self, fn: Replay) -> Replay:
        if self.stream is None:
            torch.cuda.synchronize(self.device)
            self.memory_before = (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(self.device)
        # Eager runs first, on the capture stream: lazy set-up (cuBLAS workspaces, RoPE tables,
        # torch.compile'd regions compiling for this size) must not happen inside the capture.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(self.warmup_runs):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        # NOTE: the same stream for every capture into the shared pool (torch.cuda.graph's docs).
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        self.graphs.append(graph)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    def summary(self) -> str:
        torch.cuda.synchronize(self.device)
        allocated = torch.cuda.memory_allocated(self.device) - self.memory_before[0]
        reserved = torch.cuda.memory_reserved(self.device) - self.memory_before[1]
        return f"; graph memory: {allocated / 2**20:.1f} MiB allocated, {reserved / 2**20:.1f} MiB reserved"

    def release(self) -> None:
        self.graphs.clear()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------
# Replaying decode steps
# ---------------------------------------------------------------------------
class DecodeGraphs:
    """A :data:`~modserve.api.StepForward` that replays captured graphs for decode steps.

    A step of B decodes (one new token per sequence) with B up to the largest size runs as
    the graph of the next captured size P >= B: its tensors copied into rows [:B] of the
    static buffers, rows [B:P] padding that writes nothing and reads one finite key, and
    rows [:B] of the output returned. Any other step (prefill, mixed, several tokens per
    sequence, too many sequences) calls ``forward`` eagerly. If a capture fails, every
    step does (``sizes`` is then empty).

    NOTE: the output of a replay is the graph's static tensor: valid until the next step.
    """

    def __init__(self, forward: StepForward, sizes: list[int], settings: GraphSettings, device: torch.device,
                 recorder: Recorder) -> None:
        self.forward = forward
        self.recorder = recorder
        self.max_model_len = settings.max_model_len
        n = max(sizes)
        width = -(-settings.max_model_len // settings.block_size)  # blocks of the longest sequence
        as_ints = dict(dtype=torch.int64, device=device)
        # Static inputs, [n] per row unless noted; they hold the padding until a step copies in.
        self.input_ids = torch.zeros(n, **as_ints)
        self.positions = torch.zeros(n, **as_ints)
        self.slot_mapping = torch.full((n,), -1, **as_ints)  # -1: writes nowhere
        self.query_start_loc = torch.arange(n + 1, **as_ints)  # [n + 1]: one token per sequence, always
        self.query_lens = torch.ones(n, **as_ints)
        self.context_lens = torch.zeros(n, **as_ints)
        self.seq_lens = torch.ones(n, **as_ints)  # 1: a padding row reads one key, block 0's first
        self.block_tables = torch.zeros(n, width, **as_ints)  # [n, width]
        self.dirty_rows = 0  # rows [:dirty_rows] may hold an earlier step's values, not padding
        self.metas = {p: self._static_meta(p) for p in sizes}
        self.replays: collections.Counter[int] = collections.Counter()  # per size
        self.eager_steps = 0
        self.sizes: list[int] = []
        self.graphs: dict[int, Replay] = {}
        self._capture(sorted(sizes))

    def _static_meta(self, p: int) -> AttentionMetadata:
        """Views of the buffers' first ``p`` rows; host lists at the worst case, for good: a graph
        never sees a step's host values (the backend's promise is not to read them)."""
        m = self.max_model_len
        return AttentionMetadata(
            num_tokens=p, positions=self.positions[:p], slot_mapping=self.slot_mapping[:p],
            query_start_loc=self.query_start_loc[: p + 1], query_lens=self.query_lens[:p],
            context_lens=self.context_lens[:p], seq_lens=self.seq_lens[:p], block_tables=self.block_tables[:p],
            query_lens_cpu=[1] * p, seq_lens_cpu=[m] * p, context_lens_cpu=[m - 1] * p,
            max_query_len=1, max_seq_len=m)

    def _capture(self, sizes: list[int]) -> None:
        start = time.perf_counter()
        graphs: dict[int, Replay] = {}
        p = sizes[-1]
        try:
            with torch.inference_mode():  # as every step runs
                for p in reversed(sizes):  # largest first: the smaller ones reuse its memory pool
                    ids, meta = self.input_ids[:p], self.metas[p]
                    graphs[p] = self.recorder.capture(lambda ids=ids, meta=meta: self.forward(ids, meta))
        except Exception as e:  # an op that syncs with the host, a kernel that cannot be captured
            cause = e.__context__ or e.__cause__  # torch.cuda.graph's exit may replace the first error
            logger.warning("cuda graphs: off (capturing decode batch size %d failed: %s: %s%s); every step "
                           "runs eagerly", p, type(e).__name__, e,
                           f"; while handling {type(cause).__name__}: {cause}" if cause else "")
            self.recorder.release()
            return
        self.graphs, self.sizes = graphs, sizes
        logger.info("cuda graphs: decode batch sizes %s captured in %.1f s%s", sizes,
                    time.perf_counter() - start, self.recorder.summary())

    def __call__(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [B, hidden]
        b = meta.num_seqs
        if not self.sizes or meta.num_tokens != b or meta.max_query_len != 1 or not 0 < b <= self.sizes[-1]:
            self.eager_steps += 1
            return self.forward(input_ids, meta)
        p = self.sizes[bisect.bisect_left(self.sizes, b)]
        self._copy_in(input_ids, meta, b, p)
        self.replays[p] += 1
        return self.graphs[p]()[:b]

    def _copy_in(self, input_ids: torch.Tensor, meta: AttentionMetadata, b: int, p: int) -> None:
        """Rows [:b] the step's, rows [b:p] padding. query_start_loc and query_lens never change."""
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(meta.positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.context_lens[:b].copy_(meta.context_lens)
        self.seq_lens[:b].copy_(meta.seq_lens)
        # NOTE: columns past the step's width keep older block ids: never read, a kernel reads
        # only the blocks below seq_len. Columns past the buffer's are past max_model_len.
        width = min(meta.block_tables.shape[1], self.block_tables.shape[1])
        self.block_tables[:b, :width].copy_(meta.block_tables[:, :width])
        stale = min(self.dirty_rows, p)
        if stale > b:  # rows this graph reads that an earlier, larger step filled: back to padding
            self.input_ids[b:stale].zero_()
            self.positions[b:stale].zero_()
            self.slot_mapping[b:stale].fill_(-1)
            self.context_lens[b:stale].zero_()
            self.seq_lens[b:stale].fill_(1)
            self.block_tables[b:stale].zero_()
        self.dirty_rows = self.dirty_rows if self.dirty_rows > p else b


def capture_decode_graphs(forward: StepForward, backend: AttentionBackend, settings: GraphSettings,
                          device: torch.device, recorder: Recorder) -> StepForward:
    """``forward`` itself when nothing can be captured (the reason logged), else the graphs."""
    plan = graph_plan(settings, backend)
    if not plan.sizes:
        logger.info("cuda graphs: off (%s)", plan.off_reason)
        return forward
    graphs = DecodeGraphs(forward, plan.sizes, settings, device, recorder)
    return graphs if graphs.sizes else forward
