"""One step's varlen batch as tensors, built without per-token Python loops."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from modserve.core.contracts.attention_backend import AttentionMetadata


# A decode step of up to this many sequences gets its positions and slots from Python lists,
# not numpy operations. It comes right after the step's weight reads, which left nothing of
# the process in the caches: there each numpy operation's first touch is what costs. After
# streaming the reference model's weights, a batch of one sequence took 64 us this way against
# 132, of 16 sequences 138 against 224, of 64 175 against 257; at 256 the lists were slower.
SMALL_DECODE_STEP = 64


def build_batch(
    chunks: list[list[int]],  # per sequence, the token ids computed this step
    context_lens: list[int],  # per sequence, tokens already in the KV cache
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Input ids [T] and the attention metadata for sequences whose new tokens sit
    at positions ``context_lens[i] .. context_lens[i] + len(chunks[i]) - 1``."""
    # In numpy, then one from_numpy each: the same ops as torch calls took 3x as long.
    n = len(chunks)
    q_list = [len(c) for c in chunks]
    seq_lens = [c + q for c, q in zip(context_lens, q_list)]
    table = np.zeros((n, max(len(b) for b in block_tables)), dtype=np.int64)
    for i, blocks in enumerate(block_tables):
        table[i, : len(blocks)] = blocks
    if n <= SMALL_DECODE_STEP and set(q_list) == {1}:  # one token each, at its context length
        cu, positions = list(range(n + 1)), context_lens
        slots = [b[p // block_size] * block_size + p % block_size for b, p in zip(block_tables, context_lens)]
    else:
        q_lens = np.array(q_list, dtype=np.int64)
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        # position of token t = t - start of its sequence's rows + that sequence's context length
        positions = np.arange(cu[-1], dtype=np.int64) + np.repeat(np.array(context_lens) - cu[:-1], q_lens)
        slots = table[np.repeat(np.arange(n), q_lens), positions // block_size] * block_size + positions % block_size
    num_tokens = int(cu[-1])
    ids = np.fromiter(itertools.chain.from_iterable(chunks), dtype=np.int64, count=num_tokens)
    tensor = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)  # noqa: E731
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        positions=tensor(positions),
        slot_mapping=tensor(slots),
        query_start_loc=tensor(cu),
        query_lens=tensor(q_list),
        context_lens=tensor(context_lens),
        seq_lens=tensor(seq_lens),
        block_tables=tensor(table),
        query_lens_cpu=q_list,
        seq_lens_cpu=seq_lens,
        context_lens_cpu=list(context_lens),
        max_query_len=max(q_list),
        max_seq_len=max(seq_lens),
    )
    return tensor(ids), meta


# pipeline_micro_batches auto: the fewest tokens a micro-batch is cut to. Below it (decodes) a
# step is mostly weight reads, which every micro-batch repeats: cut in two, decode steps of 16
# sequences ran slower, prefills faster (docs/parallelism.md).
MICRO_BATCH_MIN_TOKENS = 128


def micro_batch_count(asked: int | None, stages: int, num_tokens: int) -> int:
    """Micro-batches for a step of ``num_tokens``: ``asked``, or one per stage once each gets
    MICRO_BATCH_MIN_TOKENS, else one."""
    return asked or max(1, min(stages, num_tokens // MICRO_BATCH_MIN_TOKENS))


def split_batch(input_ids: torch.Tensor, meta: AttentionMetadata, row_sets: list[torch.Tensor],
                parts: int) -> list[tuple[torch.Tensor, AttentionMetadata, list[torch.Tensor]]]:
    """The batch as up to ``parts`` micro-batches of whole sequences, about equal in tokens:
    each one's input ids, metadata and rows of every row set (renumbered from its first token).
    Their row sets, in order, are the batch's: sequences keep their order."""
    cu = meta.query_start_loc.cpu().numpy()
    n = meta.num_seqs
    cuts = np.searchsorted(cu, np.arange(1, parts) * meta.num_tokens / parts, side="left")
    bounds = sorted({0, n, *(int(min(max(c, 1), n - 1)) for c in cuts)}) if n > 1 else [0, n]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        t0, t1 = int(cu[a]), int(cu[b])
        sub = AttentionMetadata(
            num_tokens=t1 - t0, positions=meta.positions[t0:t1], slot_mapping=meta.slot_mapping[t0:t1],
            query_start_loc=meta.query_start_loc[a : b + 1] - t0, query_lens=meta.query_lens[a:b],
            context_lens=meta.context_lens[a:b], seq_lens=meta.seq_lens[a:b], block_tables=meta.block_tables[a:b],
            query_lens_cpu=meta.query_lens_cpu[a:b], seq_lens_cpu=meta.seq_lens_cpu[a:b],
            context_lens_cpu=meta.context_lens_cpu[a:b], max_query_len=max(meta.query_lens_cpu[a:b]),
            max_seq_len=max(meta.seq_lens_cpu[a:b]))
        out.append((input_ids[t0:t1], sub, [r[(r >= t0) & (r < t1)] - t0 for r in row_sets]))
    return out
