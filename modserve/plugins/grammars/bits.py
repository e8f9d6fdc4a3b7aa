"""Token bitmask helpers shared by the built-in backends (int32 words, bit t % 32 of word t // 32)."""

from __future__ import annotations

import numpy as np
import torch


def pack(allowed: np.ndarray) -> torch.Tensor:
    """[V] bool -> [ceil(V / 32)] int32 bitmask."""
    words = -(-len(allowed) // 32)
    padded = np.zeros(words * 32, dtype=np.uint64)
    padded[: len(allowed)] = allowed
    packed = (padded.reshape(words, 32) << np.arange(32, dtype=np.uint64)).sum(axis=1)  # [W] < 2**32
    return torch.from_numpy(packed.astype(np.uint32).view(np.int32).copy())


def set_bit(row: torch.Tensor, token_id: int) -> None:
    """Allow ``token_id`` in one bitmask row (int32 words, so bit 31 is the sign bit)."""
    word = (int(row[token_id // 32]) & 0xFFFFFFFF) | (1 << (token_id % 32))
    row[token_id // 32] = word - (1 << 32) if word >= 1 << 31 else word
