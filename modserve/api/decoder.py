"""A standard pre-norm decoder as a model describes it to a platform that runs it natively
(``CausalLM.decoder_layout``): the tensors and linears, nothing the platform must guess."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DecoderLayerLayout:
    """One layer of :class:`DecoderLayout`: ``h = x + o(attn(rope(qkv(norm1(x)))))``,
    ``x' = h + down(silu(gate) * up)`` with ``gate | up = gate_up(norm2(h))``."""

    input_norm: torch.Tensor  # [hidden] RMSNorm weight
    qkv: torch.nn.Module  # a Linear: [hidden] -> [(H + 2 Hkv) D], q | k | v, heads in order
    o_proj: torch.nn.Module  # [H D] -> [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.nn.Module  # [hidden] -> [2 I], gate | up
    down: torch.nn.Module  # [I] -> [hidden]


@dataclass(frozen=True, slots=True)
class DecoderLayout:
    """A Llama-style decoder: embedding, layers of :class:`DecoderLayerLayout` (RMSNorm with
    ``eps``, rotate-half RoPE from ``cos``/``sin`` rows at each position, grouped-query
    attention, SiLU-gated MLP), a final RMSNorm; hidden states out, normed; logits by the
    LM head alone."""

    embedding: torch.Tensor  # [vocab, hidden]
    layers: tuple[DecoderLayerLayout, ...]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.nn.Module  # [hidden] -> [vocab]: compute_logits is this linear alone, in float32
    cos: torch.Tensor  # [max_positions, D] float32
    sin: torch.Tensor  # [max_positions, D]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
