"""The model's contract (config key ``model``, by architecture name): a causal LM built on
"meta", loaded by name, run on one step's hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass
from abc import abstractmethod
from typing import Any, Callable, Iterable

import torch

from modserve.core.contracts.attention_backend import AttentionMetadata


class CausalLM(torch.nn.Module):
    """A model architecture over a flattened (varlen) batch.

    Constructed as ``cls(hf_config, attn_backend, max_positions, make_linear=...)`` on
    the "meta" device with the compute dtype as default dtype; the core moves it to the
    real device and calls ``load_weights`` with the checkpoint's ``(name, tensor)``
    pairs, then finishes the linears. Every projection comes from ``make_linear(in, out,
    bias=, shard_sizes=)`` (:mod:`modserve.runner.linear`): ``load_weights`` hands each of a
    linear's checkpoint tensors to ``linear.load(name, tensor, shard)``. The vocabulary
    projection comes from ``make_linear.lm_head(hidden, vocab)``: float weights whatever the
    quantizer, loaded as a plain parameter. A model never knows which platform runs it.

    Parallelism: under tensor parallelism ``make_linear.tp`` says this rank's share (heads,
    intermediate size) and ``parallel=`` splits each projection; the embedding comes from
    ``make_linear.embedding(vocab, hidden)``. Under pipeline parallelism the model builds
    only the decoder layers in ``make_linear.layers`` and ``forward`` is called with
    ``hidden_states=``: None on the first stage (embed ``input_ids``), else the previous
    stage's output; the last stage (its layers end at the last one) returns the normed
    hidden states, every other stage the residual stream as its last layer left it.

    Reading: a model whose ``reads_parts`` is True receives unread checkpoint handles
    (``modserve.api.CheckpointTensor``: ``shape``, ``narrow``, ``[...]``, ``chunk``; read by
    ``read()`` or ``as_tensor``), so each rank reads only the parts it keeps (its slices, its
    stage's layers, its experts); ``linear.load`` takes them as they are. Otherwise (the
    default) every tensor arrives whole.
    """

    reads_parts: bool = False

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # one per layer
        meta: AttentionMetadata,
        attn_state: Any,
    ) -> torch.Tensor:  # [T, hidden]
        ...

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        ...

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def compile_regions(self, compiler: Callable[[Callable], Callable]) -> bool:
        """Optional: replace the model's attention-free parts by ``compiler(fn)`` (a
        ``torch.compile`` that the platform configures) and return True; the attention backend
        must stay outside the compiled parts. The default compiles nothing."""
        return False

    def decoder_layout(self) -> Any:
        """Optional: the model's tensors and linears as a standard pre-norm decoder
        (a :class:`modserve.api.DecoderLayout`), for a platform that runs decode steps natively; None (the
        default) where the model computes anything else (q/k norms, experts, a pipeline
        stage, tensor parallelism)."""
        return None


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
