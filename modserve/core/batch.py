"""One step's varlen batch as tensors, built without per-token Python loops."""

from __future__ import annotations

import numpy as np
import torch

from modserve.core.interfaces import AttentionMetadata


def build_batch(
    chunks: list[list[int]],  # per sequence, the token ids computed this step
    context_lens: list[int],  # per sequence, tokens already in the KV cache
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Input ids [T] and the attention metadata for sequences whose new tokens sit
    at positions ``context_lens[i] .. context_lens[i] + len(chunks[i]) - 1``."""
    q_list = [len(c) for c in chunks]
    q_lens = torch.tensor(q_list, dtype=torch.int64)
    ctx = torch.tensor(context_lens, dtype=torch.int64)
    seq_lens = ctx + q_lens
    cu = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=cu[1:])
    num_tokens = int(cu[-1])
    # position of token t = t - start of its sequence's rows + that sequence's context length
    positions = torch.arange(num_tokens) + torch.repeat_interleave(ctx - cu[:-1], q_lens)
    table = np.zeros((len(chunks), max(len(b) for b in block_tables)), dtype=np.int64)
    for i, blocks in enumerate(block_tables):
        table[i, : len(blocks)] = blocks
    tables = torch.from_numpy(table)
    rows = torch.repeat_interleave(torch.arange(len(chunks)), q_lens)
    slot_mapping = tables[rows, positions // block_size] * block_size + positions % block_size
    ids = [t for c in chunks for t in c]
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        query_start_loc=cu.to(device),
        query_lens=q_lens.to(device),
        context_lens=ctx.to(device),
        seq_lens=seq_lens.to(device),
        block_tables=tables.to(device),
        query_lens_cpu=q_list,
        seq_lens_cpu=seq_lens.tolist(),
        context_lens_cpu=list(context_lens),
        max_query_len=max(q_list),
        max_seq_len=int(seq_lens.max()),
    )
    return torch.tensor(ids, dtype=torch.int64, device=device), meta


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
