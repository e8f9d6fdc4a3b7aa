"""Mixtral: the Mistral block with every MLP a sparse block of ``num_local_experts`` experts
(``intermediate_size`` each), top ``num_experts_per_tok``, the top-k weights renormalized
to sum to 1 and kept in float32."""

from __future__ import annotations

from typing import Any

from torch import nn

from modserve.api import LinearFactory
from modserve.plugins.models.llama import DecoderLayer
from modserve.plugins.models.moe import MoEForCausalLM, SparseMoeBlock


class MixtralDecoderLayer(DecoderLayer):
    def make_mlp(self, config: Any, make_linear: LinearFactory) -> nn.Module:
        return SparseMoeBlock(config, make_linear, num_experts=config.num_local_experts,
                              top_k=config.num_experts_per_tok, intermediate=config.intermediate_size,
                              renormalize=True, round_weights=False)


class MixtralForCausalLM(MoEForCausalLM):
    LAYER = MixtralDecoderLayer
