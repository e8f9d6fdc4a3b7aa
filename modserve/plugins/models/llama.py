"""Llama-family decoder (Llama, Mistral, Qwen2) over a flattened varlen batch.

Fused projections (q|k|v and gate|up) make one GEMM where Hugging Face runs
several; ``load_weights`` hands the checkpoint's separate tensors to them as shards.
Every projection comes from ``make_linear``, so how its weights are stored (float,
int8, AWQ, ...) is the quantizer's business, and how float ones are multiplied the
platform's; embeddings and the LM head (``make_linear.lm_head``) stay float.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from modserve.api import (
    AttentionBackend, CausalLM, CheckpointTensor, DecoderLayerLayout, DecoderLayout, Linear, LinearFactory, as_tensor,
    attention, forward_context, linear_factory)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers, so float32 results match bit for bit.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: Any, head_dim: int) -> torch.Tensor:
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths slowed by `factor`,
        # short ones kept, a smooth blend between.
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.config = config
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def build(self, device: torch.device) -> None:
        # Built lazily on the real device: the model is constructed on "meta".
        inv_freq = rope_inv_freq(self.config, self.head_dim).to(device)
        t = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None or self.cos.device != positions.device:
            self.build(positions.device)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Under tensor parallelism (``make_linear.tp``) each rank holds its share of the query
    heads and of the KV heads (a whole KV head on each of several ranks when the ranks
    outnumber them, as vLLM does): column-parallel qkv, row-parallel o_proj."""

    def __init__(self, config: Any, make_linear: LinearFactory) -> None:
        super().__init__()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        tp = make_linear.tp
        kv_replicas = max(1, tp.size // kv_heads)
        self.num_heads = tp.part(heads)[1]  # this rank's
        self.num_kv_heads = tp.part(kv_heads, kv_replicas)[1]
        # Qwen2 has q/k/v bias without saying so; Qwen2-MoE says so as qkv_bias.
        bias = (bool(getattr(config, "attention_bias", False)) or bool(getattr(config, "qkv_bias", False))
                or config.model_type == "qwen2")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q, kv = heads * self.head_dim, kv_heads * self.head_dim  # the checkpoint's
        self.qkv_proj = make_linear(config.hidden_size, q + 2 * kv, bias=bias, shard_sizes=(q, kv, kv),
                                    parallel="column", shard_replicas=(1, kv_replicas, kv_replicas))
        self.o_proj = make_linear(q, config.hidden_size, bias=bool(getattr(config, "attention_bias", False)),
                                  parallel="row")

    def project(self, x: torch.Tensor, positions: torch.Tensor,
                rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[T, H, D]`` and keys, values ``[T, Hkv, D]``, rotated."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.norm_heads(q, k)
        q, k = rope(positions, q, k)
        return q, k, v

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Before RoPE, per head (Qwen3's q/k norm); Llama: none."""
        return q, k


class MLP(nn.Module):
    def __init__(self, config: Any, make_linear: LinearFactory, intermediate_size: int | None = None) -> None:
        super().__init__()
        full = intermediate_size or config.intermediate_size  # another size: a MoE model's dense or shared MLP
        self.intermediate = make_linear.tp.part(full)[1]  # this rank's
        self.gate_up_proj = make_linear(config.hidden_size, 2 * full, shard_sizes=(full, full), parallel="column")
        self.down_proj = make_linear(full, config.hidden_size, parallel="row")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (supported: silu)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int, make_linear: LinearFactory) -> None:
        super().__init__()
        self.index = index
        self.self_attn = self.make_attention(config, make_linear)
        self.mlp = self.make_mlp(config, make_linear)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_attention(self, config: Any, make_linear: LinearFactory) -> Attention:
        return Attention(config, make_linear)

    def make_mlp(self, config: Any, make_linear: LinearFactory) -> nn.Module:
        """The feed-forward block of layer ``self.index``: ``[T, hidden] -> [T, hidden]``."""
        return MLP(config, make_linear)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        q, k, v = self.self_attn.project(self.input_layernorm(x), positions, rope)
        out = attention(q, k, v, self.index)  # [T, H, D]; the backend comes from the forward context
        x = x + self.self_attn.o_proj(out.reshape(x.shape[0], -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    # checkpoint module name -> (our fused linear, shard index)
    STACKED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    LAYER: type[DecoderLayer] = DecoderLayer  # a subclass's own decoder layer
    reads_parts = True  # load_weights takes checkpoint handles and reads only what this rank keeps

    def __init__(self, config: Any, backend: AttentionBackend, max_positions: int,
                 make_linear: LinearFactory | None = None) -> None:
        super().__init__()
        make_linear = make_linear or linear_factory(None, torch.get_default_dtype(), torch.device("cpu"))
        self.config = config
        self.embed_tokens = make_linear.embedding(config.vocab_size, config.hidden_size)
        self.backend = backend
        # A pipeline stage builds its layers only; the others stay empty placeholders.
        num_layers = config.num_hidden_layers
        self.stage = make_linear.layers or range(num_layers)
        self.last_stage = self.stage.stop == num_layers
        self.layers = nn.ModuleList(self.LAYER(config, i, make_linear) if i in self.stage else nn.Identity()
                                    for i in range(num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = make_linear.lm_head(config.hidden_size, config.vocab_size)
        self.tie_weights()
        attn = self.layers[self.stage.start].self_attn
        self.rope = RotaryEmbedding(config, attn.head_dim, max_positions)

    def forward(self, input_ids, positions, kv_caches, meta, attn_state, hidden_states=None) -> torch.Tensor:
        with forward_context(self.backend, kv_caches, meta, attn_state):
            return self.run_layers(input_ids, positions, hidden_states)

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Tensors in, hidden states ``[T, hidden]`` out (a pipeline stage: the previous
        stage's in, the residual stream out, normed by the last stage only)."""
        x = self.embed_tokens(input_ids) if hidden_states is None else hidden_states  # [T, hidden]
        for i in self.stage:
            x = self.layers[i](x, positions, self.rope)
        return self.norm(x) if self.last_stage else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [N, vocab]

    def tie_weights(self) -> None:
        """A tied head multiplies by the embedding itself (moving the model unties them)."""
        if self.tie:
            self.lm_head.weight = self.embed_tokens.weight

    def compile_regions(self, compiler: Callable[[Callable], Callable]) -> bool:
        """A decoder layer (attention an opaque op inside it) and the logits. One layer graph
        serves all layers, their weights its inputs: a whole-model graph ran no faster
        and took twice as long to trace at every start (~20 s against ~8 s for this one)."""
        layer_forward = compiler(DecoderLayer.forward)
        for i in self.stage:
            self.layers[i].forward = functools.partial(layer_forward, self.layers[i])
        self.compute_logits = functools.partial(compiler(type(self).compute_logits), self)
        self.rope.build(self.embed_tokens.weight.device)  # no lazy branch inside the graph
        return True

    def decoder_layout(self) -> DecoderLayout | None:
        """Plain Llama layers only: a subclass that changes a layer (q/k norms, experts), a
        pipeline stage or tensor parallelism computes something else."""
        layers = list(self.layers)
        attn = layers[0].self_attn if layers else None
        plain = (attn is not None and self.stage == range(len(layers)) and self.embed_tokens.tp.size == 1
                 and all(type(m) is DecoderLayer and type(m.self_attn) is Attention and type(m.mlp) is MLP
                         for m in layers))
        if not plain:
            return None
        self.rope.build(self.embed_tokens.weight.device)
        return DecoderLayout(
            self.embed_tokens.weight, tuple(DecoderLayerLayout(
                m.input_layernorm.weight, m.self_attn.qkv_proj, m.self_attn.o_proj, m.post_attention_layernorm.weight,
                m.mlp.gate_up_proj, m.mlp.down_proj) for m in layers),
            self.norm.weight, self.lm_head, self.rope.cos, self.rope.sin, attn.num_heads, attn.num_kv_heads,
            attn.head_dim, self.norm.eps)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tensors of a linear go to it (``layers.0.self_attn.q_proj.qweight`` -> shard 0 of
        ``qkv_proj``, as ``qweight``); the core checks the linears are complete."""
        self.tie_weights()
        linears = {name: m for name, m in self.named_modules() if isinstance(m, Linear)}
        params = {name: p for name, p in self.named_parameters() if name.rpartition(".")[0] not in linears}
        # The embedding and the LM head take their rank's rows of the vocabulary themselves.
        vocab = {"embed_tokens.weight": self.embed_tokens, "lm_head.weight": self.lm_head}
        loaded: set[str] = set()
        for name, tensor in self.checkpoint_tensors(weights):
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (self.tie and name.startswith("lm_head.")) or not self._in_stage(name):
                continue
            module, _, leaf = name.rpartition(".")
            target, shard = self.locate(module)
            linear = linears.get(target)
            if linear is not None:
                linear.load(leaf, tensor, shard)
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            if name in vocab:
                vocab[name].load(name, tensor)
            else:
                _copy(param, tensor, name)
            loaded.add(name)
        missing = {name for name in set(params) - loaded if self._in_stage(name)}
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {sorted(missing)[:8]}")
        with torch.no_grad():  # another stage's embedding, norm or head: unread, unused, zeros
            for name in set(params) - loaded:
                params[name].zero_()

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as ``load_weights`` takes them (a subclass renames or splits
        some: a MoE model its experts'); here, as they are."""
        return weights

    def locate(self, module: str) -> tuple[str, int]:
        """The linear a checkpoint module's tensors go to, and which output shard of it:
        ``layers.0.self_attn.k_proj`` -> (``layers.0.self_attn.qkv_proj``, 1)."""
        parent, _, child = module.rpartition(".")
        target, shard = self.STACKED.get(child, (child, 0))
        return f"{parent}.{target}", shard

    def _in_stage(self, name: str) -> bool:
        """False for a tensor this pipeline stage never uses, which it does not read: another
        stage's decoder layer, the embedding past the first stage (unless the last one's LM head
        is tied to it), the final norm and the LM head before the last. (Those stay allocated,
        unread and unused.)"""
        if name.startswith("layers."):
            return int(name.split(".", 2)[1]) in self.stage
        if name.startswith("embed_tokens."):
            return self.stage.start == 0 or (self.tie and self.last_stage)
        if name.startswith(("norm.", "lm_head.")):
            return self.last_stage
        return True


def _copy(dst: torch.Tensor, src: torch.Tensor | CheckpointTensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(as_tensor(src))
