"""Qwen2-MoE and Qwen3-MoE: sparse blocks of ``num_experts`` experts (``moe_intermediate_size``
each) on the layers :func:`is_sparse_layer` picks, dense MLPs (``intermediate_size``) on the
others; the top-k weights renormalized only when ``norm_topk_prob``, then cast to the model's
dtype as transformers does.

Qwen2-MoE: Qwen2 attention (q/k/v bias) and a shared expert gated by
``sigmoid(shared_expert_gate(x))``. Qwen3-MoE: Qwen3 attention (q/k norm), no shared expert.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from modserve.api import LinearFactory
from modserve.plugins.models.llama import MLP, DecoderLayer
from modserve.plugins.models.moe import MoEForCausalLM, SparseMoeBlock, is_sparse_layer
from modserve.plugins.models.qwen3 import Qwen3DecoderLayer


def qwen_mlp(config: Any, index: int, make_linear: LinearFactory, shared_intermediate: int) -> nn.Module:
    if not is_sparse_layer(config, index):
        return MLP(config, make_linear)
    return SparseMoeBlock(config, make_linear, num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                          intermediate=config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                          round_weights=True, shared_intermediate=shared_intermediate)


class Qwen2MoeDecoderLayer(DecoderLayer):
    def make_mlp(self, config: Any, make_linear: LinearFactory) -> nn.Module:
        return qwen_mlp(config, self.index, make_linear, config.shared_expert_intermediate_size)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config: Any, make_linear: LinearFactory) -> nn.Module:
        return qwen_mlp(config, self.index, make_linear, 0)


class Qwen2MoeForCausalLM(MoEForCausalLM):
    LAYER = Qwen2MoeDecoderLayer


class Qwen3MoeForCausalLM(MoEForCausalLM):
    LAYER = Qwen3MoeDecoderLayer
