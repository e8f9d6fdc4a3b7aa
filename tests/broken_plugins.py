"""A plugin of deliberately broken implementations, one planted fault each, for
tests/test_conformance.py: the conformance kit must fail every one of them.

Each is a built-in with one thing done wrong, so a failure can only come from that fault;
the built-ins themselves are registered too, under other names (``*_copy``), as controls
that the same mechanism lets pass. Registered in-process (``Registry.add_plugin``) or, as a
third party would, through a distribution's ``modserve`` entry point.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar, Sequence as Seq

import torch

from modserve.api import (
    AttentionBackend, AttentionMetadata, BlockTransfer, CudaGraphSupport, GrammarBackend, GrammarMatcher,
    GrammarSpec, KVConnectorContext, LoRARequest, Proposal, Register, Schedule, SchedulerLimits, SchedulerView,
    Sequence, TensorLayout, WorkerSpec, hookimpl, read_kv, slots, write_kv)
from modserve.api.fp8 import FP8
from modserve.attention_backends.paged import PagedAttention
from modserve.plugins.grammars.xgrammar_backend import XGrammarBackend
from modserve.plugins.executors.mp import MultiprocessExecutor, MultiprocessOptions
from modserve.plugins.executors.uni import UniExecutor
from modserve.plugins.kv_allocators.paged import PagedAllocator
from modserve.plugins.kv_connectors.host import HostMemoryConnector, HostMemoryOptions
from modserve.plugins.lora_resolvers.filesystem import FilesystemOptions, FilesystemResolver
from modserve.plugins.proposers.ngram import NgramProposer
from modserve.plugins.reasoning_parsers.think import DeepSeekR1ReasoningParser
from modserve.plugins.tool_parsers.hermes import HermesToolParser
from modserve.plugins.schedulers.fcfs import FCFSScheduler
from modserve.quantizers.awq import AWQ
from modserve.quantizers.gptq import GPTQ
from modserve.quantizers.int8 import Int8
from modserve.samplers.default import DefaultSampler
from modserve.samplers.no_repeat_ngram import NoRepeatNGram


# -- attention: the reference algorithm with one fault switched on --------------------------
class FaultyAttention(AttentionBackend):
    fault: ClassVar[str] = ""

    def kv_cache_problem(self) -> str | None:
        return None if self.spec.kv_cache_dtype in (self.spec.dtype, FP8) else "no such cache"

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        s = self.spec
        if self.fault == "blocks_in_dim_0":
            return (num_blocks, 2, s.block_size, s.num_kv_heads, s.head_dim)
        return (2, num_blocks, s.block_size, s.num_kv_heads, s.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, state: Any) -> torch.Tensor:  # [T, H, D]
        s = self.spec
        group = s.num_heads // s.num_kv_heads
        if self.fault != "skips_cache_write":
            write_kv(kv_cache, k, v, meta, s)
        if self.fault == "stray_write":
            used = set(meta.slot_mapping.div(s.block_size, rounding_mode="floor").tolist())
            kv_cache[:, next(b for b in range(kv_cache.shape[1]) if b not in used)] = 0
        out = torch.empty_like(q)
        # graph_pad_writes keeps the graph promise but for its writes: lengths from the tensors
        lengths = zip(*(t.tolist() for t in (meta.query_lens, meta.context_lens, meta.seq_lens))) \
            if self.fault == "graph_pad_writes" else zip(meta.query_lens_cpu, meta.context_lens_cpu, meta.seq_lens_cpu)
        for i, (start, (n, ctx, seq_len)) in enumerate(zip(meta.query_start_loc[:-1].tolist(), lengths)):
            pos = torch.arange(seq_len)
            at = slots(meta.block_tables[i], pos, s.block_size)
            if self.fault == "fp8_ignores_scale":
                keys = kv_cache[0].view(-1, s.num_kv_heads, s.head_dim)[at].float().to(q.dtype)
                values = kv_cache[1].view(-1, s.num_kv_heads, s.head_dim)[at].float().to(q.dtype)
            else:
                keys, values = read_kv(kv_cache, at, s)
            spread = (lambda x: x.repeat(1, group, 1)) if self.fault == "gqa_wrong_head" \
                else (lambda x: x.repeat_interleave(group, dim=1))  # head h reads KV head h // group
            keys, values = spread(keys.to(q.dtype)), spread(values.to(q.dtype))  # [L, H, D]
            mask = None if self.fault == "no_causal_mask" else pos[None, :] <= (ctx + torch.arange(n))[:, None]
            o = torch.nn.functional.scaled_dot_product_attention(
                q[start : start + n].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, scale=s.scale)  # [H, n, D]
            out[start : start + n] = o.transpose(0, 1)
        return out.float() if self.fault == "float32_output" else out


def attention(fault: str) -> type[AttentionBackend]:
    # graph_*: declares CUDA-graph capture of decodes, then breaks the promise
    graphs = CudaGraphSupport.DECODE if fault.startswith("graph_") else CudaGraphSupport.NEVER
    return type(f"Attention_{fault}", (FaultyAttention,), {"fault": fault, "cuda_graphs": graphs})


# -- KV allocators: the paged allocator, one bookkeeping fault each --------------------------
class LeaksOnFree(PagedAllocator):
    def free(self, seq: Sequence) -> None:
        if seq.block_ids:
            seq.block_ids.pop()  # the last block is never released
        super().free(seq)


class LeaksAndHidesIt(LeaksOnFree):
    def check_integrity(self, holders: Any = None) -> None:  # claims all is well
        pass


class PartialOnFailure(PagedAllocator):
    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        if self.blocks_needed(seq, num_tokens) > self.num_free_blocks():
            while self.num_free_blocks():  # takes what there is, then reports failure
                seq.block_ids.append(self._take())
            return False
        return super().allocate(seq, num_tokens)


class NoCopyOnWrite(PagedAllocator):
    def _needs_copy(self, seq: Sequence, num_tokens: int) -> bool:
        return False


class UnreportedCopies(PagedAllocator):
    def take_copies(self) -> list[tuple[int, int]]:
        super().take_copies()
        return []


class MatchesWholePrompt(PagedAllocator):
    def match_prefix(self, seq: Sequence) -> int:
        hit = super().match_prefix(seq)
        keys = self._keys(seq, seq.num_tokens // self.block_size)  # the last block too
        nxt = len(seq.block_ids)
        if hit == nxt * self.block_size and nxt < len(keys) and (block := self.cached.get(keys[nxt])) is not None:
            if self.ref_counts[block] == 0:
                del self.free_cached[block]
            self.ref_counts[block] += 1
            seq.block_ids.append(block)
            hit += self.block_size
        return hit


class FreesSharedBlocks(PagedAllocator):
    def _release(self, block: int) -> None:  # drops every holder's reference at once
        self.ref_counts[block] = 1
        super()._release(block)

    def check_integrity(self, holders: Any = None) -> None:  # and hides it from its own check
        pass


class BlocksNeededUnderreports(PagedAllocator):
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return 0


class RefusesWhenExactlyFull(PagedAllocator):
    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        needed = self.blocks_needed(seq, num_tokens)
        return False if needed and needed >= self.num_free_blocks() else super().allocate(seq, num_tokens)


class FreeKeepsTheTable(PagedAllocator):
    def free(self, seq: Sequence) -> None:
        blocks = list(seq.block_ids)
        super().free(seq)
        seq.block_ids.extend(blocks)  # released, but still listed


class ForkDropsTheLastBlock(PagedAllocator):
    def fork(self, parent: Sequence, child: Sequence) -> None:
        super().fork(parent, child)
        self._release(child.block_ids.pop())


class MissesBlockRemoved(PagedAllocator):
    def record(self, event) -> None:
        if type(event).__name__ != "BlockRemoved":  # an eviction is never reported
            super().record(event)


class MissesBlockStored(PagedAllocator):
    def record(self, event) -> None:
        if type(event).__name__ != "BlockStored" or len(event.keys) < 2:  # longer runs are never reported
            super().record(event)


# -- schedulers: first come first served, one rule broken each ------------------------------
class _Loosened(SchedulerView):
    """The core's view with one of its limits lifted."""

    def __init__(self, view: SchedulerView, limits: SchedulerLimits, extra_blocks: int = 0,
                 waiting: Seq[Sequence] | None = None) -> None:
        self.view, self.limits, self.extra = view, limits, extra_blocks
        self.running, self.swapped = view.running, view.swapped
        self.waiting = view.waiting if waiting is None else waiting

    def free_blocks(self) -> int:
        return self.view.free_blocks() + self.extra

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return self.view.blocks_needed(seq, num_new_tokens)

    def blocks_freed_by(self, seq: Sequence) -> int:
        return self.view.blocks_freed_by(seq)


def _limits(view: SchedulerView, **changes: int) -> SchedulerLimits:
    lim = view.limits
    return SchedulerLimits(**{"max_num_seqs": lim.max_num_seqs, "max_model_len": lim.max_model_len,
                              "max_num_batched_tokens": lim.max_num_batched_tokens, **changes})


class IgnoresTokenBudget(FCFSScheduler):
    def schedule(self, view: SchedulerView) -> Schedule:
        return super().schedule(_Loosened(view, _limits(view, max_num_batched_tokens=10**6)))


class IgnoresMaxNumSeqs(FCFSScheduler):
    def schedule(self, view: SchedulerView) -> Schedule:
        return super().schedule(_Loosened(view, _limits(view, max_num_seqs=10**6)))


class IgnoresBlocks(FCFSScheduler):
    def schedule(self, view: SchedulerView) -> Schedule:
        return super().schedule(_Loosened(view, view.limits, extra_blocks=10**6))


class PreemptsWaiting(FCFSScheduler):
    def schedule(self, view: SchedulerView) -> Schedule:
        out = super().schedule(view)
        out.preempt += [s for s in view.waiting if s not in out.tokens][:1]
        return out


class StarvesLongPrompts(FCFSScheduler):
    def schedule(self, view: SchedulerView) -> Schedule:
        short = [s for s in view.waiting if s.num_prompt_tokens <= 20]
        return super().schedule(_Loosened(view, view.limits, waiting=short))


class ReturnsDict(FCFSScheduler):
    def schedule(self, view: SchedulerView) -> Any:
        return dict(super().schedule(view).tokens)


class GivesTooManyTokens(FCFSScheduler):
    def schedule(self, view: SchedulerView) -> Schedule:
        out = super().schedule(view)
        out.tokens = {seq: n + 1 for seq, n in out.tokens.items()}
        return out


class SchedulesAPreemptedOne(FCFSScheduler):
    def schedule(self, view: SchedulerView) -> Schedule:
        out = super().schedule(view)
        if out.preempt:
            out.tokens[out.preempt[0]] = 1
        return out


class ReordersTheQueue(FCFSScheduler):
    def schedule(self, view: SchedulerView) -> Schedule:
        view.waiting.reverse()  # writes what it may only read
        return super().schedule(view)


# -- samplers: the default sampler, one step wrong each -------------------------------------
class GreedyNotArgmax(DefaultSampler):
    def __call__(self, logits: torch.Tensor, batch: Any) -> Any:
        out = super().__call__(logits, batch)
        out.token_ids = torch.where(batch.temperature == 0, logits.argmin(-1), out.token_ids)
        return out


class Int32TokenIds(DefaultSampler):
    def __call__(self, logits: torch.Tensor, batch: Any) -> Any:
        out = super().__call__(logits, batch)
        out.token_ids = out.token_ids.int()
        return out


class TokenIdsOutOfRange(DefaultSampler):
    def __call__(self, logits: torch.Tensor, batch: Any) -> Any:
        out = super().__call__(logits, batch)
        out.token_ids = out.token_ids + self.vocab_size
        return out


class RanksFromZero(DefaultSampler):
    def __call__(self, logits: torch.Tensor, batch: Any) -> Any:
        out = super().__call__(logits, batch)
        if out.ranks is not None:
            out.ranks = out.ranks - 1
        return out


class IgnoresTemperature(DefaultSampler):
    def _shape(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        batch.temperature = torch.where(batch.temperature == 0, 0.0, 1.0)
        return super()._shape(logits, batch)


class TopKOffByOne(DefaultSampler):
    def _shape(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        batch.top_k = torch.where(batch.top_k > 0, batch.top_k + 1, batch.top_k)
        return super()._shape(logits, batch)


class ProbsIgnoreTopP(DefaultSampler):
    def probs(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        batch.any_top_p = False
        return super().probs(logits, batch)


class SeededRowsUseTheGlobalRng(DefaultSampler):
    def __call__(self, logits: torch.Tensor, batch: Any) -> Any:
        batch.generators = {}
        return super().__call__(logits, batch)


class SeededRowsAreGreedy(DefaultSampler):
    def __call__(self, logits: torch.Tensor, batch: Any) -> Any:
        out = super().__call__(logits, batch)
        for row in batch.generators:
            out.token_ids[row] = logits[row].argmax()
        return out


class IgnoresBitmask(DefaultSampler):
    def __call__(self, logits: torch.Tensor, batch: Any) -> Any:
        batch.allowed_token_bitmask = None
        return super().__call__(logits, batch)


class IgnoresBannedTokens(DefaultSampler):
    def __call__(self, logits: torch.Tensor, batch: Any) -> Any:
        batch.banned_token_ids = []
        return super().__call__(logits, batch)


class ProcessedLogprobs(DefaultSampler):
    def __call__(self, logits: torch.Tensor, batch: Any) -> Any:
        t = torch.where(batch.temperature == 0, 1.0, batch.temperature).unsqueeze(1)
        return super().__call__(logits / t, batch)  # logprobs of the tempered distribution


# -- grammar backends: xgrammar's matcher with one fault ------------------------------------
class FaultyMatcher(GrammarMatcher):
    def __init__(self, inner: GrammarMatcher, fault: str, vocab_size: int) -> None:
        self.inner, self.fault, self.vocab_size = inner, fault, vocab_size

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.fault == "ors_into_row":
            scratch = bitmask.clone()
            self.inner.fill_bitmask(scratch, row)
            bitmask[row] |= scratch[row]
        else:
            self.inner.fill_bitmask(bitmask, row)
        if self.fault == "allows_everything":
            bitmask[row] = -1
        if self.fault == "eos_anywhere":
            bitmask[row, 0] |= 1 << 2  # EOS is id 2 in the kit's vocabulary
        if self.fault == "writes_other_rows":
            bitmask[row - 1] = 0  # the row before its own

    def accept_token(self, token_id: int) -> bool:
        ok = self.inner.accept_token(token_id)
        if not ok and self.fault == "refusal_resets":
            self.inner.reset()
        return ok or self.fault == "accepts_anything"

    def rollback(self, num_tokens: int) -> None:
        if self.fault != "rollback_noop":
            self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        if self.fault == "terminated_from_the_start":
            return True
        return False if self.fault == "eos_does_not_terminate" else self.inner.is_terminated()

    def reset(self) -> None:
        if self.fault != "reset_noop":
            self.inner.reset()


class FaultyGrammar(XGrammarBackend):
    fault: ClassVar[str] = ""

    def compile(self, spec: Any) -> Any:
        try:
            return super().compile(spec)
        except ValueError as e:
            if self.fault == "compile_raises_runtime_error":
                raise RuntimeError(str(e)) from None
            raise

    def serialize(self, compiled: Any) -> bytes:
        if self.fault == "default_serialize":  # pickle: xgrammar's CompiledGrammar does not pickle
            return GrammarBackend.serialize(self, compiled)
        return super().serialize(compiled)

    def deserialize(self, data: bytes) -> Any:
        if self.fault == "deserialize_another_grammar":
            return self.compile(GrammarSpec("regex", "[a-z]+"))
        return super().deserialize(data)

    def matcher(self, compiled: Any, max_rollback: int) -> GrammarMatcher:
        return FaultyMatcher(super().matcher(compiled, max_rollback), self.fault, self.vocab.vocab_size)


def grammar(fault: str) -> type[XGrammarBackend]:
    return type(f"Grammar_{fault}", (FaultyGrammar,), {"fault": fault})


@torch.library.custom_op("modserve_broken::decode_without_write", mutates_args=("kv_cache",))
def _decode_without_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          scale: float) -> torch.Tensor:
    return torch.ops.modserve_paged.decode(q, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale)


class NativeDecodeSkipsWrite(PagedAttention):
    """paged, but the native decode op it names attends without writing the step's k, v first."""

    def native_decode(self) -> str | None:
        return "modserve_broken::decode_without_write" if self.kernel else None


# -- quantizers: int8 with one fault each ---------------------------------------------------
class ApplyIgnoresBias(Int8):
    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        bias, layer.bias = layer.bias, None
        try:
            return super().apply(layer, x)
        finally:
            layer.bias = bias


class NativeOpDropsScales(Int8):
    def native_op(self, layer: torch.nn.Module) -> tuple[str, list[torch.Tensor | None]] | None:
        native = super().native_op(layer)
        return None if native is None else (native[0], [layer.qweight, torch.ones_like(layer.scales), layer.bias])


class ApplyReturnsFloat32(Int8):
    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return super().apply(layer, x).float()


class GPTQZeroOffByOne(GPTQ):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.zero_offset = 0  # reads the v1 format's stored zeros (z - 1) as z


class DequantizeTransposed(Int8):
    def dequantize(self, layer: torch.nn.Module) -> torch.Tensor:
        return super().dequantize(layer).t().contiguous()


class ZeroWeights(Int8):  # consistent with itself, but not with the checkpoint
    def process_weights(self, layer: torch.nn.Module) -> None:
        with torch.no_grad():
            layer.qweight.zero_()
        super().process_weights(layer)


class WeightBytesForgetScales(Int8):
    def weight_bytes(self, spec: Any) -> int:
        return spec.out_features * spec.in_features


class IgnoresShardOffsets(Int8):
    def load_weight(self, layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard: int) -> None:
        super().load_weight(layer, name, tensor, 0)  # every shard lands on the first


class IgnoresUnknownNames(Int8):
    def load_weight(self, layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard: int) -> None:
        if name == "weight":
            super().load_weight(layer, name, tensor, shard)


class AWQLayoutUnpacked(AWQ):
    def tensor_layout(self, name: str, spec: Any) -> TensorLayout:
        # qweight and qzeros pack 8 output channels per int32: declared as one per element
        return dataclasses.replace(super().tensor_layout(name, spec), out_per_element=1)


class RowShardsIgnoreInStart(Int8):
    def tensor_layout(self, name: str, spec: Any) -> TensorLayout:
        return TensorLayout(in_dim=None)  # "it slices its row shards itself"...

    def load_weight(self, layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard: int) -> None:
        if layer.spec.parallel == "row":
            tensor = tensor[:, : layer.spec.in_features]  # ... from input 0 on every rank, not spec.in_start
        super().load_weight(layer, name, tensor, shard)


# -- executors: the mp executor (a worker given 1 s to stop) with one fault each -------------
class QuickMp(MultiprocessExecutor):
    def __init__(self, options: MultiprocessOptions | None = None) -> None:
        super().__init__(options or MultiprocessOptions(stop_timeout=1))


class FailedNeverSays(QuickMp):
    def failed(self) -> str | None:
        return None  # a dead worker goes unnoticed


class FailedBlocks(QuickMp):
    def failed(self) -> str | None:
        for proc in self.procs:
            proc.join(0.1)  # waits for each worker instead of looking
        return super().failed()


class ShutdownForgetsWorkers(QuickMp):
    def shutdown(self) -> None:
        self.procs, self.ranks = [], []  # neither waited for nor reaped, let alone killed


class ShutdownNeverKills(QuickMp):
    def shutdown(self) -> None:
        for proc in self.procs:
            proc.join(self.options.stop_timeout)  # waits, then leaves whoever did not stop
        self.procs, self.ranks = [], []


class WorkersGetAnotherModel(QuickMp):
    def start(self, workers: list[WorkerSpec]) -> None:
        from modserve.testing import cached_checkpoint

        other = str(cached_checkpoint("llama", "tiny", seed=1))  # same shapes, other weights
        super().start([dataclasses.replace(w, config={**w.config, "model": other}) for w in workers])


class UniRefusesVaguely(UniExecutor):
    def start(self, workers: list[WorkerSpec]) -> None:
        raise RuntimeError("cannot start workers")


# -- proposers: n-gram lookup with one fault each -------------------------------------------
class TooManyTokens(NgramProposer):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        return Proposal([(d + [3] * (k + 1))[: k + 1] for d, k in zip(super().propose(seqs, num_tokens).token_ids,
                                                                         num_tokens)])


class OutOfVocab(NgramProposer):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        return Proposal([[self.context.vocab_size] * k for k in num_tokens])


class UnnormalizedProbs(NgramProposer):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        ids = super().propose(seqs, num_tokens).token_ids
        return Proposal(ids, torch.ones(len(seqs), max(num_tokens), self.context.vocab_size))


class ProbsMissingAToken(NgramProposer):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        v = self.context.vocab_size - 1
        return Proposal(super().propose(seqs, num_tokens).token_ids, torch.full((len(seqs), max(num_tokens), v), 1 / v))


class DraftsItsImprobable(NgramProposer):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        ids = super().propose(seqs, num_tokens).token_ids
        probs = torch.zeros(len(seqs), max(num_tokens), self.context.vocab_size)
        for i, drafts in enumerate(ids):
            for j, t in enumerate(drafts):
                probs[i, j, (t + 1) % self.context.vocab_size] = 1.0  # one-hot on the wrong token
        return Proposal(ids, probs)


class DropsASequence(NgramProposer):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        return Proposal(super().propose(seqs, num_tokens).token_ids[:-1])


class ForgetUnknownRaises(NgramProposer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: set[int] = set()

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        self.seen.update(s.seq_id for s in seqs)
        return super().propose(seqs, num_tokens)

    def forget(self, seq: Sequence) -> None:
        self.seen.remove(seq.seq_id)  # KeyError for a sequence it never saw


# -- KV connectors: the host tier, a small pool, one fault each --------------------------------
class SmallHost(HostMemoryConnector):
    def __init__(self, context: KVConnectorContext, options: Any = None) -> None:
        super().__init__(context, HostMemoryOptions(num_blocks=64))


class LoadsTheWrongLayer(SmallHost):
    def load(self, transfers: list[BlockTransfer]) -> list[int]:
        failed = super().load(transfers)
        for t in transfers:  # every layer gets the first one's block
            for layer in self.context.layers[1:]:
                self.kv_caches[layer][:, t.block_id] = self.kv_caches[self.context.layers[0]][:, t.block_id]
        return failed


class CountsEveryKey(SmallHost):
    def stored_blocks(self, keys: list[str]) -> int:
        return sum(k in self.slots for k in keys)


class FailsTheRestAfterAMiss(SmallHost):
    def load(self, transfers: list[BlockTransfer]) -> list[int]:
        failed = super().load(transfers)
        return list(range(failed[0], len(transfers))) if failed else failed


class StoresHalfSavedBlocks(SmallHost):
    def finish_saves(self) -> None:
        for key in self.saving:  # as if every layer had come
            self.last_layer[key] = len(self.context.layers) - 1
        super().finish_saves()


class SavesAView(SmallHost):
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self.views: dict[str, dict[int, torch.Tensor]] = {}

    def save_layer(self, layer: int, kv_cache: torch.Tensor, transfers: list[BlockTransfer]) -> None:
        super().save_layer(layer, kv_cache, transfers)
        for t in transfers:
            self.views.setdefault(t.key, {})[layer] = kv_cache[:, t.block_id]  # no copy

    def load(self, transfers: list[BlockTransfer]) -> list[int]:
        failed = super().load(transfers)
        for t in transfers:
            for layer, view in self.views.get(t.key, {}).items():
                self.kv_caches[layer][:, t.block_id] = view
        return failed


# -- tool and reasoning parsers: the built-ins with one fault each ------------------------------
class DropsTheLastStreamedCall(HermesToolParser):
    def _diff(self, content: str, calls: list, final: bool) -> Any:  # a stream never sends the last call
        return super()._diff(content, calls[:-1], final)


class ArgumentsAsPython(HermesToolParser):
    def extract(self, text: str) -> Any:
        found = super().extract(text)  # the arguments as a Python dict's repr, not JSON
        return type(found)(found.content, [dataclasses.replace(c, arguments=repr(json.loads(c.arguments)))
                                           for c in found.calls])


class SendsAPartialMarker(DeepSeekR1ReasoningParser):
    def split(self, text: str, final: bool) -> tuple[str, str]:
        return super().split(text, True)  # holds nothing back: "</th" goes out as reasoning


class NamesTheWrongEndMarker(DeepSeekR1ReasoningParser):
    end_marker = "\n\n"  # the server would constrain from the blank line after </think>, not from </think>


class FindsNoReasoning(DeepSeekR1ReasoningParser):
    def extract(self, text: str) -> tuple[str | None, str | None]:
        return None, text


# -- LoRA resolvers: the filesystem one on the kit's directory, one fault each --------------------
class KitFilesystem(FilesystemResolver):
    def __init__(self, options: Any = None) -> None:
        from modserve.testing.conformance.adapter_dirs import kit_adapters

        super().__init__(FilesystemOptions(cache_dir=str(kit_adapters())))


class EscapesItsDirectory(KitFilesystem):
    def _inside(self, lora_name: str) -> Any:
        return self.root / lora_name  # "../x" and "/abs" too


class IgnoresTheBaseModel(KitFilesystem):
    def resolve(self, base_model_name: str, lora_name: str) -> Any:
        path = self._inside(lora_name)
        return None if path is None or not path.is_dir() else LoRARequest(lora_name, 1, str(path))


class RenamesTheAdapter(KitFilesystem):
    def resolve(self, base_model_name: str, lora_name: str) -> Any:
        found = super().resolve(base_model_name, lora_name)
        return found and LoRARequest(f"{lora_name}-v2", 1, found.lora_path)


class RaisesOnUnknownNames(KitFilesystem):
    def resolve(self, base_model_name: str, lora_name: str) -> Any:
        if self._inside(lora_name) is None or not self._inside(lora_name).is_dir():
            raise FileNotFoundError(lora_name)
        return super().resolve(base_model_name, lora_name)


# -- logits processors: the built-in no_repeat_ngram with one fault each ------------------------
class ActsOnEveryRow(NoRepeatNGram):
    def update_state(self, batch_update: Any) -> None:  # a row without arguments gets n = 2
        if batch_update is not None:
            batch_update = dataclasses.replace(batch_update, added=[
                dataclasses.replace(a, params=dataclasses.replace(a.params, extra_args=a.params.extra_args or
                                                                  {"no_repeat_ngram_size": 2}))
                for a in batch_update.added])
        super().update_state(batch_update)


class ClaimsArgmaxInvariance(NoRepeatNGram):
    def is_argmax_invariant(self) -> bool:
        return True  # the sampler would skip it for greedy rows, whose argmax it bans


class IgnoresMoves(NoRepeatNGram):
    def update_state(self, batch_update: Any) -> None:  # a moved row's state stays where it was
        if batch_update is not None:
            batch_update = dataclasses.replace(batch_update, moved=[])
        super().update_state(batch_update)


# kind -> name -> implementation; a name says what is wrong with it.
BROKEN: dict[str, dict[str, Any]] = {
    "attention_backend": {f: attention(f) for f in (
        "no_causal_mask", "skips_cache_write", "stray_write", "gqa_wrong_head", "fp8_ignores_scale",
        "float32_output", "blocks_in_dim_0", "graph_reads_host_lists", "graph_pad_writes")}
    | {"native_decode_skips_write": NativeDecodeSkipsWrite},
    "kv_allocator": {"leaks_on_free": LeaksOnFree, "leaks_and_hides_it": LeaksAndHidesIt,
                     "partial_on_failure": PartialOnFailure, "no_copy_on_write": NoCopyOnWrite,
                     "unreported_copies": UnreportedCopies, "matches_whole_prompt": MatchesWholePrompt,
                     "frees_shared_blocks": FreesSharedBlocks, "blocks_needed_underreports": BlocksNeededUnderreports,
                     "refuses_when_exactly_full": RefusesWhenExactlyFull, "free_keeps_the_table": FreeKeepsTheTable,
                     "fork_drops_the_last_block": ForkDropsTheLastBlock,
                     "misses_block_removed": MissesBlockRemoved, "misses_block_stored": MissesBlockStored},
    "scheduler": {"ignores_token_budget": IgnoresTokenBudget, "ignores_max_num_seqs": IgnoresMaxNumSeqs,
                  "ignores_blocks": IgnoresBlocks, "preempts_waiting": PreemptsWaiting,
                  "starves_long_prompts": StarvesLongPrompts, "returns_dict": ReturnsDict,
                  "reorders_the_queue": ReordersTheQueue, "gives_too_many_tokens": GivesTooManyTokens,
                  "schedules_a_preempted_one": SchedulesAPreemptedOne},
    "sampler": {"greedy_not_argmax": GreedyNotArgmax, "int32_token_ids": Int32TokenIds,
                "ignores_temperature": IgnoresTemperature, "top_k_off_by_one": TopKOffByOne,
                "probs_ignore_top_p": ProbsIgnoreTopP, "seeded_rows_use_the_global_rng": SeededRowsUseTheGlobalRng,
                "seeded_rows_are_greedy": SeededRowsAreGreedy, "ignores_bitmask": IgnoresBitmask,
                "ignores_banned_tokens": IgnoresBannedTokens, "processed_logprobs": ProcessedLogprobs,
                "token_ids_out_of_range": TokenIdsOutOfRange, "ranks_from_zero": RanksFromZero},
    "grammar_backend": {f: grammar(f) for f in (
        "allows_everything", "eos_anywhere", "ors_into_row", "writes_other_rows", "refusal_resets",
        "accepts_anything", "rollback_noop", "reset_noop", "eos_does_not_terminate", "terminated_from_the_start",
        "compile_raises_runtime_error", "default_serialize", "deserialize_another_grammar")},
    "quantizer": {"apply_ignores_bias": ApplyIgnoresBias, "dequantize_transposed": DequantizeTransposed,
                  "zero_weights": ZeroWeights, "weight_bytes_forget_scales": WeightBytesForgetScales,
                  "ignores_shard_offsets": IgnoresShardOffsets, "ignores_unknown_names": IgnoresUnknownNames,
                  "apply_returns_float32": ApplyReturnsFloat32, "gptq_zero_off_by_one": GPTQZeroOffByOne,
                  "awq_layout_unpacked": AWQLayoutUnpacked, "row_shards_ignore_in_start": RowShardsIgnoreInStart,
                  "native_op_drops_scales": NativeOpDropsScales},
    "proposer": {"too_many_tokens": TooManyTokens, "out_of_vocab": OutOfVocab,
                 "unnormalized_probs": UnnormalizedProbs, "forget_unknown_raises": ForgetUnknownRaises,
                 "probs_missing_a_token": ProbsMissingAToken, "drafts_its_improbable": DraftsItsImprobable,
                 "drops_a_sequence": DropsASequence},
    "executor": {"failed_never_says": FailedNeverSays, "failed_blocks": FailedBlocks,
                 "shutdown_forgets_workers": ShutdownForgetsWorkers, "shutdown_never_kills": ShutdownNeverKills,
                 "workers_get_another_model": WorkersGetAnotherModel, "uni_refuses_vaguely": UniRefusesVaguely},
    "tool_parser": {"drops_the_last_streamed_call": DropsTheLastStreamedCall,
                    "arguments_as_python": ArgumentsAsPython},
    "reasoning_parser": {"sends_a_partial_marker": SendsAPartialMarker, "finds_no_reasoning": FindsNoReasoning,
                         "names_the_wrong_end_marker": NamesTheWrongEndMarker},
    "kv_connector": {"loads_the_wrong_layer": LoadsTheWrongLayer, "counts_every_key": CountsEveryKey,
                     "fails_the_rest_after_a_miss": FailsTheRestAfterAMiss, "saves_a_view": SavesAView,
                     "stores_half_saved_blocks": StoresHalfSavedBlocks},
    "logits_processor": {"acts_on_every_row": ActsOnEveryRow, "claims_argmax_invariance": ClaimsArgmaxInvariance,
                         "ignores_moves": IgnoresMoves},
    "lora_resolver": {"escapes_its_directory": EscapesItsDirectory, "ignores_the_base_model": IgnoresTheBaseModel,
                      "renames_the_adapter": RenamesTheAdapter, "raises_on_unknown_names": RaisesOnUnknownNames},
}
# The built-ins, under other names: the kit must pass them through this very plugin.
CONTROLS: dict[str, dict[str, str]] = {
    "attention_backend": {"reference_copy": "modserve.attention_backends.reference:ReferenceAttention"},
    "kv_allocator": {"paged_copy": "modserve.plugins.kv_allocators.paged:PagedAllocator",
                     "radix_copy": "modserve.plugins.kv_allocators.radix:RadixAllocator"},
    "scheduler": {"fcfs_copy": "modserve.plugins.schedulers.fcfs:FCFSScheduler"},
    "sampler": {"default_copy": "modserve.samplers.default:DefaultSampler"},
    "grammar_backend": {"xgrammar_copy": "modserve.plugins.grammars.xgrammar_backend:XGrammarBackend"},
    "quantizer": {"int8_copy": "modserve.quantizers.int8:Int8"},
    "proposer": {"ngram_copy": "modserve.plugins.proposers.ngram:NgramProposer"},
    "executor": {"quick_mp": f"{__name__}:QuickMp"},  # mp, as the broken ones are before their fault
    "tool_parser": {"hermes_copy": "modserve.plugins.tool_parsers.hermes:HermesToolParser",
                    "pythonic_copy": "modserve.plugins.tool_parsers.pythonic:PythonicToolParser"},
    "reasoning_parser": {"deepseek_r1_copy": "modserve.plugins.reasoning_parsers.think:DeepSeekR1ReasoningParser"},
    "lora_resolver": {"filesystem_kit": f"{__name__}:KitFilesystem"},  # the built-in on the kit's directory
    "logits_processor": {"no_repeat_ngram_copy": "modserve.samplers.no_repeat_ngram:NoRepeatNGram"},
    "kv_connector": {"small_host": f"{__name__}:SmallHost",
                     "shm_copy": "modserve.plugins.kv_connectors.shm:SharedMemoryConnector"},
}

# A built-in that cannot run without options: outside modserve, the kit gets them from the command line.
NEEDS_OPTIONS: dict[str, dict[str, tuple[str, str]]] = {
    "proposer": {"draft_model_copy": ("modserve.plugins.proposers.draft_model:DraftModelProposer",
                                      "modserve.plugins.proposers.draft_model:DraftModelOptions")},
}


def _register(kind: str, register: Register) -> None:
    for name, cls in BROKEN[kind].items():
        register(name, cls, description=f"broken on purpose: {name.replace('_', ' ')}")
    for name, target in CONTROLS[kind].items():
        register(name, target, description="a built-in under another name")
    for name, (target, options) in NEEDS_OPTIONS.get(kind, {}).items():
        register(name, target, options=options, description="a built-in that needs options")


@hookimpl
def register_attention_backends(register: Register) -> None:
    _register("attention_backend", register)


@hookimpl
def register_kv_allocators(register: Register) -> None:
    _register("kv_allocator", register)


@hookimpl
def register_schedulers(register: Register) -> None:
    _register("scheduler", register)


@hookimpl
def register_samplers(register: Register) -> None:
    _register("sampler", register)


@hookimpl
def register_grammar_backends(register: Register) -> None:
    _register("grammar_backend", register)


@hookimpl
def register_quantizers(register: Register) -> None:
    _register("quantizer", register)


@hookimpl
def register_proposers(register: Register) -> None:
    _register("proposer", register)


@hookimpl
def register_executors(register: Register) -> None:
    _register("executor", register)


@hookimpl
def register_kv_connectors(register: Register) -> None:
    _register("kv_connector", register)


@hookimpl
def register_tool_parsers(register: Register) -> None:
    _register("tool_parser", register)


@hookimpl
def register_reasoning_parsers(register: Register) -> None:
    _register("reasoning_parser", register)


@hookimpl
def register_lora_resolvers(register: Register) -> None:
    _register("lora_resolver", register)


@hookimpl
def register_logits_processors(register: Register) -> None:
    _register("logits_processor", register)
