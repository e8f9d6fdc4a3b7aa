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
