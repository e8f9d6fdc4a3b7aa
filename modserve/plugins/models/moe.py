"""Mixture-of-experts pieces: the routed experts, the sparse block that routes tokens to
them, and a Llama-family model base that loads either checkpoint layout of the experts.

The experts are per-expert ``Linear``s from ``make_linear`` (gate|up fused, down), so a
quantizer applies to each expert as to any projection, and tensor parallelism splits each
expert's intermediate dimension like the dense MLP's. How the routed tokens meet their
experts is the engine's MoE backend's business (``make_linear.moe_backend``).
"""

from __future__ import annotations

import itertools
import re
import weakref
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from modserve.api import LinearFactory, MoEBackend, linear_factory
from modserve.plugins.models.llama import MLP, LlamaForCausalLM


class Experts(nn.Module):
    """This rank's SwiGLU MLPs of a layer's ``num_experts``: ``gate_up[e]`` ``[hidden -> 2I]``
    (the gate and up shards), ``down[e]`` ``[I -> hidden]``.

    Under tensor parallelism, by default every rank holds all experts, each split like the dense
    MLP (``gate_up`` column-parallel, ``down`` row-parallel: expert tensor parallelism). With
    ``make_linear.expert_parallel`` a rank holds whole experts ``first .. first + len(gate_up)``
    instead, and the layer sums the ranks' outputs (:class:`SparseMoeBlock`).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, make_linear: LinearFactory) -> None:
        super().__init__()
        i, tp = intermediate, make_linear.tp
        self.tp = tp
        self.expert_parallel = make_linear.expert_parallel and tp.size > 1
        self.first, count = expert_share(num_experts, tp.rank, tp.size) if self.expert_parallel else (0, num_experts)
        column, row = (None, None) if self.expert_parallel else ("column", "row")
        self.gate_up = nn.ModuleList(make_linear(hidden, 2 * i, shard_sizes=(i, i), parallel=column)
                                     for _ in range(count))
        self.down = nn.ModuleList(make_linear(i, hidden, parallel=row) for _ in range(count))

    def local_id(self, expert: int) -> int | None:
        """The index here of global expert ``expert``, or None where another rank holds it."""
        local = expert - self.first
        return local if 0 <= local < len(self.gate_up) else None


def expert_share(num_experts: int, rank: int, ranks: int) -> tuple[int, int]:
    """(first, count) of the experts rank ``rank`` of ``ranks`` holds under expert parallelism:
    contiguous runs, the first ``num_experts % ranks`` ranks one expert more (7 over 2: 4 and 3)."""
    if num_experts < ranks:
        raise ValueError(f"expert parallelism: {num_experts} experts cannot be split over {ranks} ranks "
                         "(set enable_expert_parallel: false to split each expert instead)")
    base, extra = divmod(num_experts, ranks)
    return rank * base + min(rank, extra), base + (rank < extra)


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          round_to: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> (expert ids ``[T, K]`` int64, weights ``[T, K]`` float32).

    The softmax is taken in float32 whatever the model's dtype (transformers does the same:
    in bfloat16 near-equal probabilities would tie and pick other experts). ``round_to``: the
    Qwen MoE models cast the weights to the model's dtype before weighting; Mixtral doesn't.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_to is not None:
        weights = weights.to(round_to).float()
    return ids, weights


class SparseMoeBlock(nn.Module):
    """``[T, hidden] -> [T, hidden]``: each token through its top-k experts, weighted, plus
    (Qwen2-MoE) a shared expert scaled by ``sigmoid(shared_expert_gate(x))``.

    The router and the shared-expert gate stay float and whole on every rank: every rank must
    pick the same experts, and a few quantized router logits can change which.
    """

    def __init__(self, config: Any, make_linear: LinearFactory, *, num_experts: int, top_k: int,
                 intermediate: int, renormalize: bool, round_weights: bool, shared_intermediate: int = 0) -> None:
        super().__init__()
        if make_linear.moe_backend is None:
            raise ValueError("a mixture-of-experts model needs make_linear.moe_backend (config moe_backend:)")
        self.backend: MoEBackend = make_linear.moe_backend
        self.top_k, self.renormalize, self.round_weights = top_k, renormalize, round_weights
        hidden = config.hidden_size
        float_linear = linear_factory(None, make_linear.dtype, make_linear.device, make_linear.float_method,
                                      make_linear.tp)
        self.gate = float_linear(hidden, num_experts)
        self.experts = Experts(num_experts, hidden, intermediate, make_linear)
        self.shared_expert = MLP(config, make_linear, shared_intermediate) if shared_intermediate else None
        self.shared_expert_gate = float_linear(hidden, 1) if shared_intermediate else None
        # Tokens routed to each expert so far (a token counts once per expert it picks): the
        # engine's per-expert load figures. Zeroed after loading (the model is built on "meta").
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.block_id = next(_block_ids)  # how the compiled graph's opaque op finds this block
        _BLOCKS[self.block_id] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        ids, weights = route(self.gate(x), self.top_k, self.renormalize, x.dtype if self.round_weights else None)
        if torch.compiler.is_compiling():
            out = _routed_experts_op(x, ids, weights, self.block_id)
        else:
            out = self.routed_experts(x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def routed_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]``: each token through its top-k experts (``ids``, ``weights`` ``[T, K]``), weighted."""
        flat = ids.reshape(-1)  # [T*K]
        self.expert_tokens.index_add_(0, flat, torch.ones_like(flat))  # NOTE: no host sync (bincount would)
        experts = self.experts
        if experts.expert_parallel:
            # Ids of other ranks' experts fall outside [0, local count): the backend skips them,
            # and the sum over the ranks puts every token's top-k together.
            return experts.tp.all_reduce(self.backend.forward(x, ids - experts.first, weights, experts))
        return self.backend.forward(x, ids, weights, experts)


# Under torch.compile the routed experts are one opaque op, as attention is: each expert gets a
# data-dependent number of tokens and the backends loop over experts on the host, which a
# fullgraph trace cannot take; the router, the shared expert and the rest of the layer fuse.
_BLOCKS: weakref.WeakValueDictionary[int, SparseMoeBlock] = weakref.WeakValueDictionary()
_block_ids = itertools.count()


@torch.library.custom_op("modserve::moe_routed_experts", mutates_args=())
def _routed_experts_op(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, block: int) -> torch.Tensor:
    # Counts into the block's expert_tokens buffer, which is no input of the op: no graph reads it.
    return _BLOCKS[block].routed_experts(x, ids, weights).contiguous()


@_routed_experts_op.register_fake
def _(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, block: int) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def is_sparse_layer(config: Any, index: int) -> bool:
    """Qwen MoE: layer ``index`` is a sparse block unless ``mlp_only_layers`` lists it or it
    falls between every ``decoder_sparse_step``-th layer (1-based), as transformers decides."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_mlp = getattr(config, "mlp_only_layers", None) or []
    return index not in only_mlp and config.num_experts > 0 and (index + 1) % step == 0


# Mixtral's transformers-4 names: block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down).
_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_LINEAR = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}
_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(.+)$")
_EXPERT_MODULE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family model whose layers may hold a :class:`SparseMoeBlock` as ``mlp``.

    Loads both layouts of the experts: transformers 4's per-expert tensors
    (``mlp.experts.{e}.gate_proj.weight``; Mixtral ``block_sparse_moe.experts.{e}.w1.weight``)
    and transformers 5's fused ones (``mlp.experts.gate_up_proj`` ``[E, 2I, hidden]``, gate
    rows first, and ``mlp.experts.down_proj`` ``[E, hidden, I]``), which are split per expert.
    """

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every expert's tensors per expert, under this rank's numbering of the experts it holds
        (expert parallelism: the others' are dropped unread; a fused ``[E, ...]`` tensor is read
        in this rank's experts' rows only)."""
        experts = {name: m for name, m in self.named_modules() if isinstance(m, Experts)}
        for name, tensor in self._per_expert(weights):
            if m := _EXPERT_TENSOR.match(name):
                prefix, e, rest = m.groups()
                held = experts.get(prefix.removeprefix("model."))
                if held is not None:
                    local = held.local_id(int(e))
                    if local is None:
                        continue
                    name = f"{prefix}.{local}.{rest}"
            yield name, tensor

    def _per_expert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            name = _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m[1]}.{_MIXTRAL_LINEAR[m[2]]}.", name)
            prefix, _, leaf = name.rpartition(".")
            if prefix.endswith(".experts") and leaf == "gate_up_proj":
                gate, up = tensor.chunk(2, dim=1)  # [E, I, hidden] each
                for e in range(tensor.shape[0]):
                    yield f"{prefix}.{e}.gate_proj.weight", gate[e]
                    yield f"{prefix}.{e}.up_proj.weight", up[e]
            elif prefix.endswith(".experts") and leaf == "down_proj":
                for e in range(tensor.shape[0]):
                    yield f"{prefix}.{e}.down_proj.weight", tensor[e]  # [hidden, I]
            else:
                yield name, tensor

    def locate(self, module: str) -> tuple[str, int]:
        """``layers.1.mlp.experts.3.up_proj`` -> (``layers.1.mlp.experts.gate_up.3``, 1)."""
        if m := _EXPERT_MODULE.match(module):
            experts, e, kind = m.groups()
            if kind == "down_proj":
                return f"{experts}.down.{e}", 0
            return f"{experts}.gate_up.{e}", 0 if kind == "gate_proj" else 1
        return super().locate(module)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        # NOTE: before the runner's finish_linears (a quantizer's process_weights) runs: a
        # backend that stacks quantized experts' tensors would see them unprocessed.
        for i in self.stage:
            block = self.layers[i].mlp
            if isinstance(block, SparseMoeBlock):
                block.backend.prepare(block.experts)
                block.expert_tokens.zero_()
