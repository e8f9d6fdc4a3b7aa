"""Qwen3: the Llama block with an RMSNorm over each query and key head before RoPE.

Its ``head_dim`` comes from the config (heads x head_dim need not be the hidden size);
q/k/v and o carry a bias only when ``attention_bias`` says so.
"""

from __future__ import annotations

from typing import Any

import torch

from modserve.api import LinearFactory
from modserve.plugins.models.llama import Attention, DecoderLayer, LlamaForCausalLM, RMSNorm


class QKNormAttention(Attention):
    def __init__(self, config: Any, make_linear: LinearFactory) -> None:
        super().__init__(config, make_linear)
        # One weight of head_dim shared by all heads (and by every rank under TP).
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # [T, H, D], [T, Hkv, D]


class Qwen3DecoderLayer(DecoderLayer):
    def make_attention(self, config: Any, make_linear: LinearFactory) -> Attention:
        return QKNormAttention(config, make_linear)


class Qwen3ForCausalLM(LlamaForCausalLM):
    LAYER = Qwen3DecoderLayer
