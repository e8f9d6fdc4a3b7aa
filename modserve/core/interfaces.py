"""The contracts every implementation follows, one small ABC per kind.

An implementation lives in its own module, registers through a hook in
:mod:`modserve.core.hookspecs`, and is constructed by the core with the
arguments documented on each ``__init__`` here plus ``options``: the validated
pydantic model it declared (or None).
"""

from __future__ import annotations

import enum
import pickle
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Literal, NamedTuple, Sequence as Seq

import torch
from pydantic import BaseModel

from modserve.core.sequence import Sequence
from modserve.core.structured_outputs import GrammarSpec


# ---------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------
@dataclass(slots=True)
class AttentionSpec:
    """The attention shape of a model, fixed at start-up."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    block_size: int
    dtype: torch.dtype
    device: torch.device
    # What the KV cache stores. A dtype other than ``dtype`` (float8_e4m3fn) holds
    # ``k / k_scale`` and ``v / v_scale``: one scale per cache tensor.
    kv_cache_dtype: torch.dtype | None = None  # None: dtype
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kv_cache_dtype is None:
            self.kv_cache_dtype = self.dtype


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch layout, built once per step and shared by every layer.

    The batch is the concatenation of each sequence's new tokens ("varlen"):
    sequence ``i`` owns query rows ``query_start_loc[i] : query_start_loc[i+1]``,
    at positions ``context_lens[i] .. seq_lens[i] - 1``. A decode is simply a
    sequence with one new token; a (chunked) prefill has several.
    """

    num_tokens: int
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) per new token
    query_start_loc: torch.Tensor  # [B + 1] int64
    query_lens: torch.Tensor  # [B] int64
    context_lens: torch.Tensor  # [B] int64: tokens already in the cache before this step
    seq_lens: torch.Tensor  # [B] int64: context_lens + query_lens
    block_tables: torch.Tensor  # [B, max_blocks] int64, rows padded with 0
    # The same on the host, for backends that loop over sequences.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    context_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)


class CudaGraphSupport(enum.Enum):
    """What of a step a CUDA graph may capture around an attention backend (vLLM's
    ``AttentionCGSupport``): the platform captures no more than the backend declares."""

    NEVER = "never"
    DECODE = "decode"  # steps of decodes only (one new token per sequence), per batch size


class AttentionBackend(ABC):
    """Causal attention over a paged KV cache for a mixed prefill+decode batch.

    Contract: ``forward`` first writes this step's ``k``/``v`` into ``kv_cache``
    at ``meta.slot_mapping``, then returns, for every query row, attention over
    that sequence's keys at positions ``<=`` its own (its cached context plus the
    new tokens), with grouped-query heads (``num_heads % num_kv_heads == 0``).
    Every backend must give the same result as ``reference`` up to float error.
    With a quantized cache (``spec.kv_cache_dtype``), every key and value is read as
    stored, this step's included.

    ``cuda_graphs = DECODE`` promises more, for steps of decodes only: ``prepare`` and
    ``forward`` launch the same work whatever the values in ``meta``'s tensors, for a given
    ``num_seqs`` (a graph replays them on new values). They read nothing per step from the
    host (``*_cpu`` and ``max_seq_len`` hold the worst case, ``max_model_len``, at capture),
    never sync with the device, and a slot of -1 in ``slot_mapping`` writes nowhere (the
    padding rows of a captured batch).
    """

    cuda_graphs: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER

    def __init__(self, spec: AttentionSpec, options: BaseModel | None = None) -> None:
        self.spec = spec
        self.options = options

    def kv_cache_problem(self) -> str | None:
        """Why this backend cannot use a cache of ``spec.kv_cache_dtype``; None if it can.
        Default: it reads only a cache in the compute dtype."""
        if self.spec.kv_cache_dtype != self.spec.dtype:
            return f"{type(self).__name__} reads only a KV cache in the compute dtype ({self.spec.dtype})"
        return None

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache. Default: [2 (k, v), blocks, block_size, kv_heads, head_dim].
        NOTE: dimension 1 must stay the block index: block copies and swaps index it."""
        s = self.spec
        return (2, num_blocks, s.block_size, s.num_kv_heads, s.head_dim)

    def prepare(self, meta: AttentionMetadata) -> Any:
        """Per-step work shared by all layers (index tensors, masks). Result goes to ``forward``."""
        return None

    def native_decode(self) -> str | None:
        """The qualified name of a registered op that does ``forward``'s work for a step of
        decodes only, in sequence order, without ``prepare``: ``(q [T, H, D], k, v [T, Hkv, D],
        kv_cache, slot_mapping [T], block_tables [T, max_blocks], seq_lens [T], scale: float)
        -> [T, H, D]``, writing k, v first. A platform's native decode step calls it with no
        Python around it. Default: None (no such op; the platform keeps the Python forward)."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # kv_cache_shape(num_blocks)
        meta: AttentionMetadata,
        state: Any,
    ) -> torch.Tensor:  # [T, H, D]
        ...


# ---------------------------------------------------------------------------
# Mixture-of-experts layers
# ---------------------------------------------------------------------------
class MoEBackend(ABC):
    """How a mixture-of-experts layer computes its routed experts.

    Contract: ``forward`` returns, for every token row ``t``,
    ``sum_k topk_weights[t, k] * E_{topk_ids[t, k]}(x[t])`` with expert ``e``'s MLP
    ``E_e(x) = down[e](silu(gate_up[e](x)[:I]) * gate_up[e](x)[I:])``, where ``experts.gate_up``
    and ``experts.down`` are ``nn.ModuleList``s of this layer's ``Linear``s (made by the model's
    ``make_linear``: quantized or not, this rank's shard under tensor parallelism) and ``I`` is
    ``experts.gate_up[e]``'s output size over 2. Ids not in ``[0, len(experts.gate_up))`` add
    nothing. Every backend gives ``reference``'s result up to float error. ``prepare`` runs once
    per layer after the weights are loaded (stacking them, say); it may keep what it builds on
    ``experts``.
    """

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options

    def prepare(self, experts: torch.nn.Module) -> None:
        """Once per layer, after loading. Default: nothing."""

    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        topk_ids: torch.Tensor,  # [T, K] int64
        topk_weights: torch.Tensor,  # [T, K] float32
        experts: torch.nn.Module,
    ) -> torch.Tensor:  # [T, hidden] in x's dtype
        ...


# ---------------------------------------------------------------------------
# KV blocks
# ---------------------------------------------------------------------------
class KVAllocator(ABC):
    """Hands out the KV cache's blocks to sequences.

    Contract: block ids are ints in ``[0, num_blocks)``; ``seq.block_ids`` is the
    sequence's block table, owned by the allocator (callers only read it).
    ``allocate`` is all-or-nothing. After ``free`` of every live sequence,
    ``num_free_blocks() == num_blocks`` (blocks kept only as prefix cache count as
    free: they are evicted on demand). Allocate and free are O(1) per block.
    A block shared by several sequences is never written in place: ``allocate``
    copies it first (copy-on-write) and reports the copy through ``take_copies``.
    """

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 options: BaseModel | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.options = options

    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` could hand out now."""

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``allocate(seq, num_tokens)`` would take."""
        needed = -(-num_tokens // self.block_size)
        return max(0, needed - len(seq.block_ids))

    def blocks_freed_by(self, seq: Sequence) -> int:
        """Blocks that ``free(seq)`` would return (shared blocks stay with their other holders)."""
        return len(seq.block_ids)

    @abstractmethod
    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Make ``seq.block_ids`` cover ``num_tokens`` tokens, ready for writes from
        ``seq.num_computed_tokens`` on. False (and no change) if short of blocks."""

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` and empty its table."""

    def match_prefix(self, seq: Sequence) -> int:
        """For a sequence with no blocks: attach cached blocks holding a prefix of its
        tokens and return how many tokens they cover (always fewer than
        ``seq.num_tokens``: the last token is computed to get logits).
        Allocators without a prefix cache return 0."""
        return 0

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """How many tokens ``match_prefix(seq)`` would attach now; changes nothing (a
        scheduling policy may ask it of waiting sequences). Default: 0."""
        return 0

    def mark_computed(self, seq: Sequence) -> None:
        """Called after a step wrote KV up to ``seq.num_computed_tokens``, so full
        blocks can be published to a prefix cache. Default: nothing."""

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release blocks past the first ``num_tokens`` tokens (rejected speculative
        slots). Default: keep them; the sequence reuses them as it grows."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Make ``child`` (no blocks yet) share all of ``parent``'s blocks."""
        raise NotImplementedError(f"{type(self).__name__} does not support fork")

    def take_copies(self) -> list[tuple[int, int]]:
        """(source, destination) block copies that must happen before the next forward."""
        return []

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay in use): later requests compute
        their prompts in full. Default: nothing is cached, nothing to do."""

    def stats(self) -> dict[str, float]:
        """Counters for engine stats and /metrics."""
        return {"num_blocks": self.num_blocks, "free_blocks": self.num_free_blocks()}

    def check_integrity(self, holders: Iterable[Sequence] | None = None) -> None:
        """Raise ``AssertionError`` (or ``ValueError``) describing the first inconsistency in the
        allocator's bookkeeping: a block both free and held, a block neither free nor held, a
        block id outside ``[0, num_blocks)``, a free count that differs from ``num_free_blocks()``.
        With ``holders`` (every sequence holding blocks), also reference counts that do not match
        the holders' block tables. Changes nothing; only tests call it (the conformance kit, after
        every operation), so it need not be fast. Default: what the base class can see, the
        free count's range and the holders' block ids."""
        free = self.num_free_blocks()
        if not 0 <= free <= self.num_blocks:
            raise AssertionError(f"num_free_blocks() = {free}, outside [0, num_blocks={self.num_blocks}]")
        held: set[int] = set()
        for seq in holders or ():
            bad = [b for b in seq.block_ids if not (isinstance(b, int) and 0 <= b < self.num_blocks)]
            if bad:
                raise AssertionError(f"sequence {seq.seq_id} holds block ids {bad}, outside [0, {self.num_blocks})")
            if len(set(seq.block_ids)) != len(seq.block_ids):
                raise AssertionError(f"sequence {seq.seq_id} lists a block twice: {seq.block_ids}")
            held.update(seq.block_ids)
        if len(held) + free > self.num_blocks:
            raise AssertionError(f"{len(held)} blocks are held and num_free_blocks() = {free}: more than "
                                 f"num_blocks={self.num_blocks}, so a held block counts as free")


# ---------------------------------------------------------------------------
# KV beyond this engine's cache
# ---------------------------------------------------------------------------
KVRole = Literal["producer", "consumer", "both"]


@dataclass(frozen=True, slots=True)
class KVConnectorContext:
    """What a KV connector knows of the engine it serves; every rank makes its own."""

    role: KVRole  # producer: saves only; consumer: loads only; both
    spec: AttentionSpec  # this rank's heads, the cache dtype
    layers: range  # the layers this rank caches
    # The checkpoint, the backend's block layout and the parallel layout in one string:
    # blocks saved under another one never match (they would be another model's KV or bytes).
    namespace: str
    tp_rank: int = 0
    tp_size: int = 1


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """One full block of a prompt to load into, or save from, the paged cache."""

    key: str  # its content: a hash chained over the prompt's tokens up to the block's end
    block_id: int  # where it is in this engine's cache


class KVConnector(ABC):
    """Moves full prompt blocks of KV between this engine's paged cache and a store outside
    it (files, shared memory, host memory, another engine), keyed by content.

    One class on two sides, as vLLM's ``KVConnectorBase_V1``: rank 0's instance also
    answers the scheduler (``stored_blocks``); every rank's instance moves its own layers
    and heads. A block is ``kv_cache[layer][:, block_id]`` (dimension 1 of every backend's
    cache is the block), so a connector sees blocks, not models.

    The core calls, per step: ``load`` before the forward for the blocks of newly
    admitted sequences the store holds (a sequence whose load fails is recomputed or
    failed, per ``kv_load_failure_policy``); ``save_layer`` as each layer's attention
    has written the step's KV, for the full prompt blocks complete by the end of the
    step; ``finish_saves`` after the forward. A save must be loadable once
    ``finish_saves`` returns, and must never be seen half written.
    """

    def __init__(self, context: KVConnectorContext, options: BaseModel | None = None) -> None:
        self.context = context
        self.options = options

    # -- scheduler side (rank 0) --------------------------------------------------------
    @abstractmethod
    def stored_blocks(self, keys: list[str]) -> int:
        """How many leading blocks of this key chain every rank could load now."""

    # -- worker side (every rank) -------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The paged cache, one tensor per layer (empty for other ranks' layers), once."""
        self.kv_caches = kv_caches

    @abstractmethod
    def load(self, transfers: list[BlockTransfer]) -> list[int]:
        """Copy each block from the store into the cache, for this rank's layers; return
        the indices of the transfers that failed (missing, corrupt): the core drops their
        sequences' blocks, so a failed one may leave its block half written."""

    @abstractmethod
    def save_layer(self, layer: int, kv_cache: torch.Tensor, transfers: list[BlockTransfer]) -> None:
        """Take these blocks of one layer's cache (``kv_cache_shape``), just written."""

    def finish_saves(self) -> None:
        """Make this step's saves loadable (after the forward). Default: nothing left."""

    def close(self) -> None:
        """The engine stops: release what the connector holds (segments, temp files)."""

    def stats(self) -> dict[str, float]:
        """Counters for engine stats and /metrics (bytes moved, hits)."""
        return {}


# ---------------------------------------------------------------------------
# Scheduling
# ---------------------------------------------------------------------------
@dataclass(slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(slots=True)
class Schedule:
    """What a scheduling policy decided for one step.

    ``tokens[seq]`` is how many of ``seq``'s uncomputed tokens to compute now;
    ``preempt`` lists running sequences to evict (their blocks freed, progress reset).
    """

    tokens: dict[Sequence, int] = field(default_factory=dict)
    preempt: list[Sequence] = field(default_factory=list)


class SchedulerView(ABC):
    """What a policy may read: the core's queues, limits and block budget."""

    waiting: Seq[Sequence]  # arrival order (sequences preempted by recompute go back in front)
    running: Seq[Sequence]  # admission order
    swapped: Seq[Sequence]  # preempted by swap, in preemption order; resume by scheduling them
    limits: SchedulerLimits

    @abstractmethod
    def free_blocks(self) -> int: ...

    @abstractmethod
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks that computing ``num_new_tokens`` more tokens of ``seq`` takes."""

    @abstractmethod
    def blocks_freed_by(self, seq: Sequence) -> int:
        """Blocks that preempting ``seq`` gives back."""

    def cached_tokens(self, seq: Sequence) -> int:
        """Tokens of waiting ``seq``'s prompt the prefix cache holds now (what admitting it
        would skip). Default: 0, a view without a prefix cache."""
        return 0


class Scheduler(ABC):
    """A scheduling policy: picks which sequences run each step and how far.

    Contract: ``schedule`` only reads ``view``. The core validates the result
    (known sequences, within ``max_num_seqs`` and ``max_num_batched_tokens``,
    blocks available after the preemptions) and rejects an invalid one with an
    error naming the plugin. Sequences not mentioned simply wait this step.
    """

    def __init__(self, limits: SchedulerLimits, options: BaseModel | None = None) -> None:
        self.limits = limits
        self.options = options

    @abstractmethod
    def schedule(self, view: SchedulerView) -> Schedule: ...


# ---------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------
@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling settings for one step, as tensors on the logits' device. Samplers
    only read them: while a step's sequences stay the same, the runner passes the same
    tensors again."""

    temperature: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor  # [B] int64; <= 0 = off
    top_p: torch.Tensor  # [B] float
    min_p: torch.Tensor  # [B] float
    repetition_penalty: torch.Tensor  # [B]
    presence_penalty: torch.Tensor  # [B]
    frequency_penalty: torch.Tensor  # [B]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    generators: dict[int, torch.Generator]  # row -> seeded generator
    prompt_token_ids: torch.Tensor | None  # [B, P] padded with vocab_size, only with penalties
    output_token_ids: torch.Tensor | None  # [B, O] padded with vocab_size, only with penalties
    banned_token_ids: list[tuple[int, list[int]]]  # (row, ids) never to sample this step (min_tokens)
    max_num_logprobs: int  # -1 when no row wants logprobs
    # [B, ceil(V / 32)] int32: bit t % 32 of word t // 32 set = token t may be sampled.
    # Rows without a grammar are all ones; None when no row has one.
    allowed_token_bitmask: torch.Tensor | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] logprob of the sampled token
    ranks: torch.Tensor | None = None  # [B] rank of the sampled token (1 = most likely)
    top_ids: torch.Tensor | None = None  # [B, K]
    top_logprobs: torch.Tensor | None = None  # [B, K]


class Sampler(ABC):
    """Turns one row of logits per sequence into the next token.

    Contract: greedy rows (temperature 0) take the argmax of the penalised
    logits; rows with a generator draw only from it, so a seeded request gives
    the same tokens whatever else is in the batch. Logprobs are of the model's
    raw distribution (log_softmax of the unprocessed logits). With an
    ``allowed_token_bitmask``, a row samples only tokens whose bit is set.
    """

    def __init__(self, vocab_size: int, options: BaseModel | None = None) -> None:
        self.vocab_size = vocab_size
        self.options = options

    @abstractmethod
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput: ...

    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[B, V] the distribution each random row samples from, after every mask,
        penalty and shaping step. Speculative decoding verifies drafts against it."""
        raise NotImplementedError(f"{type(self).__name__} cannot give its sampling distribution")


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------
class CausalLM(torch.nn.Module):
    """A model architecture over a flattened (varlen) batch.

    Constructed as ``cls(hf_config, attn_backend, max_positions, make_linear=...)`` on
    the "meta" device with the compute dtype as default dtype; the core moves it to the
    real device and calls ``load_weights`` with the checkpoint's ``(name, tensor)``
    pairs, then finishes the linears. Every projection comes from ``make_linear(in, out,
    bias=, shard_sizes=)`` (:mod:`modserve.core.linear`): ``load_weights`` hands each of a
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
    """

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


# ---------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LinearSpec:
    """One linear layer as the model declares it: ``y = x @ W.T + b`` with ``W: [out, in]``.

    ``shard_sizes`` lists the output rows of each checkpoint tensor fused into the layer,
    in order (q, k, v for a fused qkv_proj); ``(out_features,)`` for an unfused layer.

    Under tensor parallelism the sizes are this rank's: a ``column`` layer holds rows
    ``shard_starts[i]:+shard_sizes[i]`` of each checkpoint shard, a ``row`` layer inputs
    ``in_start:+in_features`` (and all-reduces its output). The core slices each checkpoint
    tensor along the dimensions :meth:`Quantizer.tensor_layout` names before
    ``load_weight`` sees it, so a quantizer loads a rank's tensors as a whole layer's.
    """

    in_features: int
    out_features: int
    shard_sizes: tuple[int, ...]
    bias: bool
    dtype: torch.dtype  # activations, and the weights of an unquantized layer
    device: torch.device  # where the weights will live (kernels are chosen by it)
    parallel: str | None = None  # "column", "row" or None (replicated: every rank holds it whole)
    tp_size: int = 1
    shard_starts: tuple[int, ...] = ()  # column: this rank's first row in each checkpoint shard
    in_start: int = 0  # row: this rank's first input channel

    def shard_offset(self, shard: int) -> int:
        return sum(self.shard_sizes[:shard])

    @property
    def full_in_features(self) -> int:
        """The checkpoint's input channels (``in_features`` but for a row-parallel shard)."""
        return self.in_features * self.tp_size if self.parallel == "row" else self.in_features


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where a checkpoint tensor of a linear keeps its output and input channels: the
    dimension of each (None: not split, every rank loads it whole) and how many channels
    one element covers along it (8 int4 values packed in an int32; a group's scale)."""

    out_dim: int | None = 0
    in_dim: int | None = 1
    out_per_element: int = 1
    in_per_element: int = 1


class Quantizer(ABC):
    """How every quantized linear layer of a model stores its weights and runs its matmul.

    One instance per engine. For each :class:`~modserve.core.linear.Linear` the core calls,
    in this order:

    1. ``create_weights(layer, spec)`` while the model is built on the "meta" device:
       register on ``layer`` every tensor the layer keeps (``torch.nn.Parameter`` with
       ``requires_grad=False`` or buffers), in its final dtype. ``layer.bias`` (float,
       ``[out]``) is the core's.
    2. ``load_weight(layer, name, tensor, shard)`` once per checkpoint tensor of the layer:
       ``name`` is the tensor's last name part (``"weight"``, ``"qweight"``, ...), ``shard``
       indexes ``spec.shard_sizes``. Fused shards arrive in any order; a name the quantizer
       does not read is an error naming it.
    3. ``process_weights(layer)`` once, after every tensor is loaded: repack for a kernel,
       drop staging tensors.
    4. ``apply(layer, x)`` on every forward: ``x: [T, in]`` in ``spec.dtype`` to
       ``[T, out]``, plus ``layer.bias`` when it is not None.

    ``dequantize(layer)`` returns the ``[out, in]`` float32 weight the layer stands for,
    exactly (the tests compare it bit for bit with a reference dequantization), and
    ``weight_bytes(spec)`` the bytes the layer keeps after ``process_weights``, for
    capacity planning (the tests check it against what the engine allocated).

    A quantizer for pre-quantized checkpoints names the ``quantization_config.quant_method``
    values it reads in ``checkpoint_methods`` and receives that config as ``checkpoint_config``;
    one that quantizes a float checkpoint at load leaves it empty.
    """

    checkpoint_methods: tuple[str, ...] = ()

    def __init__(self, checkpoint_config: dict[str, Any] | None = None,
                 options: BaseModel | None = None) -> None:
        self.checkpoint_config = checkpoint_config or {}
        self.options = options

    def tensor_names(self, spec: LinearSpec) -> tuple[str, ...]:
        """Checkpoint tensors every shard of a layer must provide (besides its bias)."""
        return ("weight",)

    def tensor_layout(self, name: str, spec: LinearSpec) -> TensorLayout:
        """How checkpoint tensor ``name`` splits under tensor parallelism. Default: an
        ``[out, in]`` weight. Only asked when ``spec.tp_size > 1``."""
        return TensorLayout()

    @abstractmethod
    def create_weights(self, layer: torch.nn.Module, spec: LinearSpec) -> None: ...

    @abstractmethod
    def load_weight(self, layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard: int) -> None: ...

    def process_weights(self, layer: torch.nn.Module) -> None:
        """Called once after loading. Default: nothing."""

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def dequantize(self, layer: torch.nn.Module) -> torch.Tensor:  # [out, in] float32
        ...

    @abstractmethod
    def weight_bytes(self, spec: LinearSpec) -> int: ...

    def traceable(self) -> bool:
        """Asked once every layer's weights are processed: whether ``apply`` traces under
        ``torch.compile`` (every op it calls has a fake kernel; no Python state changes
        between calls), so ``compile: auto`` may compile the model as an unquantized one.
        Default: False (the model runs eagerly unless ``compile: on``)."""
        return False

    def native_op(self, layer: torch.nn.Module) -> tuple[str, list[torch.Tensor | None]] | None:
        """``apply(layer, x)`` as one registered op, for callers with no Python between ops (a
        platform's native decode step): the op's qualified name and the arguments after ``x``,
        such that ``op(x, *args)`` returns what ``apply`` does for float32 ``x [T, in]``, any
        ``T``. Asked after ``process_weights``. Default: None (no such op)."""
        return None


# ---------------------------------------------------------------------------
# Platforms
# ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelLoad:
    """A model whose weights are loaded, as :meth:`Platform.finish_model` sees it."""

    compile: str  # the compile setting: auto, on, off
    dtype_setting: str  # the dtype setting: auto or a dtype's name
    prepack_weights: str  # auto, on, off
    dtype: torch.dtype  # the compute dtype
    checkpoint_dtype: torch.dtype  # the checkpoint's own
    quantized: bool  # a quantizer owns the projections' weights (never the LM head's)
    quantizer_traceable: bool = False  # its apply traces under torch.compile (Quantizer.traceable)


class FinishedModel(NamedTuple):
    """What :meth:`Platform.finish_model` did."""

    compiled: bool  # its regions run compiled: the engine warms them up before serving
    decode_weight_bytes: int | None = None  # what batch-1 decode reads, where copies were added for it
    packed_weight_bytes: int = 0  # extra weight copies for batched GEMMs


@dataclass(frozen=True, slots=True)
class GraphSettings:
    """What :meth:`Platform.capture_graphs` may capture."""

    sizes: tuple[int, ...] | None  # batch sizes to capture; None: the platform's default; (): none
    attention_backend: str  # its name in the config, for the log
    max_num_seqs: int
    max_model_len: int
    block_size: int
    # The model and its KV caches (one per layer), for a platform that runs decode steps
    # itself (a native step) instead of replaying graphs of ``forward``.
    model: CausalLM | None = None
    kv_caches: tuple[torch.Tensor, ...] = ()


# One step's forward: (input_ids [T], meta) -> hidden states [T, hidden].
StepForward = Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]


class Platform(ABC):
    """One device type's answers to what the core would otherwise ask with ``if device.type``:
    the compute dtype, the memory left for the KV cache, process tuning, when to compile,
    and how linears without a quantizer (and the LM head) keep and multiply their weights.

    Contract: one per engine, made as ``cls(device, options=)`` before anything is loaded.
    Every method runs at start-up, none per step (only the linear method's ``apply`` does),
    in this order: ``prepare_process``,
    ``resolve_dtype``, ``linear_method`` (while the model is built on "meta"),
    ``finish_model`` (once its weights are loaded and its linears finished),
    ``available_memory`` (when the KV cache is sized). Whatever ``finish_model`` adds lives
    on the layers the linear method multiplies (:func:`modserve.core.linear.float_layers`),
    and only that method reads it: the model stays the same on every platform.
    """

    # The torch.distributed backend of this device's tensor-parallel collectives.
    distributed_backend: ClassVar[str] = "gloo"

    def __init__(self, device: torch.device, options: BaseModel | None = None) -> None:
        self.device = device
        self.options = options

    def prepare_process(self) -> None:
        """Process-wide tuning before the model is loaded (the host allocator). Default: nothing."""

    def describe(self) -> str:
        """The hardware and the kernel routes it takes, for a benchmark's header. Default: the device."""
        return str(self.device)

    def auto_kv_cache_dtype(self, compute: torch.dtype, checkpoint: torch.dtype, dtype_setting: str) -> torch.dtype:
        """What ``kv_cache_dtype: auto`` stores, where the attention backend can read it (else the
        compute dtype). Default: the compute dtype."""
        return compute

    @abstractmethod
    def resolve_dtype(self, name: str, checkpoint: torch.dtype) -> torch.dtype:
        """The compute dtype for ``dtype: name``: that dtype, or for ``auto`` this device's
        choice for a checkpoint stored in ``checkpoint`` (logged, saying why)."""

    @abstractmethod
    def available_memory(self) -> int:
        """Bytes the device can allocate now; ``kv_cache_memory_fraction`` is a share of them."""

    def linear_method(self) -> Quantizer:
        """How linears without a quantizer, and the LM head, store and multiply their float
        weights: an :class:`~modserve.core.linear.Unquantized`. Default: ``F.linear``."""
        from modserve.core.linear import Unquantized

        return Unquantized()

    @abstractmethod
    def finish_model(self, model: CausalLM, load: ModelLoad) -> FinishedModel:
        """Once, after loading: compile the model's regions or not (``load.compile``; see
        :func:`CausalLM.compile_regions`), and give the linear method's layers the weight
        copies it reads. A setting of ``on`` that cannot work here is a ``ValueError``
        saying why; an ``auto`` that stays off logs why."""

    def capture_graphs(self, forward: StepForward, backend: AttentionBackend,
                       settings: GraphSettings) -> StepForward:
        """Once the KV cache is allocated, on every rank: what runs a step's forward from now
        on. ``forward`` itself (the default: every step eager), or a replacement that replays
        graphs captured of ``forward`` for the steps they fit (no more than ``backend.cuda_graphs``
        allows) and calls ``forward`` for the others, giving the same hidden states."""
        return forward


# ---------------------------------------------------------------------------
# Structured outputs and speculative decoding
# ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GrammarVocab:
    """The tokenizer as a grammar backend sees it; built once per engine."""

    # One entry per logits column: the bytes that token adds to the text, or None
    # for ids a grammar never allows (special tokens, ids past the tokenizer's).
    token_bytes: tuple[bytes | None, ...]
    eos_token_ids: tuple[int, ...]  # allowed only where the grammar may end
    key: str  # identifies this vocabulary; part of the compiled-grammar cache key

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)


class GrammarMatcher(ABC):
    """One sequence's progress through a compiled grammar; used on the engine thread.

    Contract: a new matcher is at the grammar's start. ``fill_bitmask`` overwrites
    ``bitmask[row]`` (int32, CPU, ``ceil(V / 32)`` words) so that bit ``t % 32`` of
    word ``t // 32`` is set exactly for the tokens that may come next; EOS ids are
    set only where the grammar may end. ``accept_token`` advances by one token, or
    returns False and changes nothing if the grammar forbids it. Accepting an EOS id
    terminates the matcher (``is_terminated``); it is then never filled again.
    ``rollback(n)`` undoes the last ``n`` accepted tokens, a terminating EOS
    included, for any ``n`` up to the ``max_rollback`` it was made with.
    ``reset`` returns to the start.
    """

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    @abstractmethod
    def accept_token(self, token_id: int) -> bool: ...

    @abstractmethod
    def rollback(self, num_tokens: int) -> None: ...

    @abstractmethod
    def is_terminated(self) -> bool: ...

    @abstractmethod
    def reset(self) -> None: ...


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer and makes per-sequence matchers.

    Contract: made when a request first needs it, once in the engine's process and
    once in each grammar compile worker process (``grammar_compile_isolation``). The
    core passes ``compile`` only specs whose kind is in ``kinds``. ``compile`` may be
    slow and runs in a worker, possibly beside other compiles, which may be killed at
    ``grammar_compile_timeout``; it raises ``ValueError`` saying why a spec is refused
    (invalid, or a feature this backend lacks), and that message reaches the user.
    Its result comes back to the engine's process as ``serialize``'s bytes, read by
    ``deserialize`` there (defaults: pickle); the core caches it and shares it between
    requests, so it must never change. ``matcher`` is cheap and runs on the engine thread.
    """

    kinds: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, vocab: GrammarVocab, options: BaseModel | None = None) -> None:
        self.vocab = vocab
        self.options = options

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any: ...

    @abstractmethod
    def matcher(self, compiled: Any, max_rollback: int) -> GrammarMatcher: ...

    def serialize(self, compiled: Any) -> bytes:
        """``compile``'s result as bytes, in the worker process that compiled it."""
        return pickle.dumps(compiled)

    def deserialize(self, data: bytes) -> Any:
        """``serialize``'s bytes as ``compile``'s result again, in the engine's process."""
        return pickle.loads(data)


@dataclass(slots=True)
class ProposerContext:
    """What a proposer may need to build itself: the engine's settings and resources."""

    config: Any  # EngineConfig
    registry: Any  # Registry, to load a draft model's architecture and attention backend
    device: torch.device
    dtype: torch.dtype
    num_blocks: int  # a proposer with its own KV cache shares the target's block tables
    block_size: int
    max_model_len: int
    vocab_size: int
    sampler: "Sampler"  # to turn draft logits into the request's processed distribution

    def load_model(self, model: str) -> Any:
        """A second checkpoint (a draft sharing the target's tokenizer) ready to run beside the
        target: a :class:`~modserve.core.model_runner.ModelRunner` on the engine's device and
        dtype, with KV tensors of its own for ``num_blocks`` blocks, indexed by the target's
        block tables, so it needs no allocator. Run it with ``last_token_logits(seqs, chunks,
        context_lens)``; ``sampling_batch(seqs)`` gives the requests' settings for ``sampler``.
        Its own checkpoint decides its quantization (a float draft of an AWQ target stays float).
        A checkpoint of another vocabulary size is a ``ValueError``, raised before any weight loads."""
        from modserve.core.loader import load_hf_config
        from modserve.core.model_runner import ModelRunner  # NOTE: imported here, it imports this module

        hf_config = load_hf_config(model)
        if hf_config.vocab_size != self.vocab_size:
            raise ValueError(f"draft vocab_size {hf_config.vocab_size} differs from the target's "
                             f"{self.vocab_size}: the draft must share the tokenizer")
        # No CUDA graphs: a draft runs its own forward, never the captured step.
        config = self.config.model_copy(update={"model": model, "quantization": None, "cuda_graph_sizes": []})
        runner = ModelRunner(config, hf_config, self.registry, self.dtype, self.max_model_len, set(), progress=False)
        runner.allocate_kv_cache(self.num_blocks)
        return runner


@dataclass(slots=True)
class Proposal:
    token_ids: list[list[int]]  # per sequence, at most k draft tokens continuing seq.token_ids
    # [B, K, V] the distributions the drafts were drawn from (rows past a sequence's
    # drafts are ignored); None when proposals are deterministic (q is one-hot).
    probs: torch.Tensor | None = None


class Proposer(ABC):
    """Proposes draft tokens for speculative decoding.

    Contract: ``propose(seqs, num_tokens)`` is called once per step for sequences about
    to decode, after each one's KV blocks for ``1 + num_tokens[i]`` new tokens were
    allocated; it returns at most ``num_tokens[i]`` tokens for sequence ``i`` (fewer, or
    none, is fine). A proposer with a KV cache of its own writes it only at slots of
    those blocks. ``forget(seq)`` is
    called when a sequence finishes, is aborted or preempted.
    """

    def __init__(self, context: ProposerContext, options: BaseModel | None = None) -> None:
        self.context = context
        self.options = options

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal: ...

    def forget(self, seq: Sequence) -> None:
        """Drop any per-sequence state."""


# ---------------------------------------------------------------------------
# Executors
# ---------------------------------------------------------------------------
@dataclass(slots=True)
class WorkerSpec:
    """What one tensor-parallel rank > 0 needs to start: ``modserve.api.run_worker(spec)``."""

    config: dict[str, Any]  # the engine's EngineConfig, as model_dump()
    rank: int
    world_size: int
    init_method: str  # tcp://host:port of rank 0's rendezvous
    backend: str  # gloo, nccl: the platform's
    plugins: list[str]  # distributions whose plugins the driver loaded: the worker loads the same
    env: dict[str, str] = field(default_factory=dict)  # the driver's MODSERVE_* and thread settings


class Executor(ABC):
    """Runs the model's tensor-parallel ranks 1..N-1 in processes of their own (rank 0 is the
    engine's process) and watches them.

    Contract: ``start(workers)`` returns once each ``modserve.api.run_worker(spec)`` is under
    way in a process of its own (it blocks until rank 0 stops it, so do not wait for it); the
    core then joins rank 0 to their group at ``rendezvous_host()``. ``failed()`` is polled by
    the engine (cheap, never blocking): why a worker is gone, or None. ``shutdown()`` runs
    after rank 0 told the workers to stop: wait a little, then kill what is left; no process
    may outlive it. A world of one rank never calls ``start``.
    """

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options

    def rendezvous_host(self) -> str:
        """An address of this process's machine that every worker can reach."""
        return "127.0.0.1"

    @abstractmethod
    def start(self, workers: list[WorkerSpec]) -> None: ...

    @abstractmethod
    def failed(self) -> str | None: ...

    @abstractmethod
    def shutdown(self) -> None: ...
