"""Turns a scheduled step into one forward pass and one sampling call."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np
import torch

from modserve.runner.batch import build_batch, micro_batch_count, split_batch
from modserve.core.config import EngineConfig
from modserve.runner.sampling import (bad_word_bans, bad_word_rows, fill_token_bitmask, joined_bitmask,
                                      logit_bias_entries, token_rule_bitmask)
from modserve.runner.forward_context import after_each_layer
from modserve.runner.input_batch import InputBatch
from modserve.runner.kv_saves import GuardedSaves
from modserve.runner.logits_processors import LogitsProcessors
from modserve.core.contracts.attention_backend import AttentionMetadata, AttentionSpec
from modserve.core.contracts.kv_connector import BlockTransfer, KVConnector, KVConnectorContext
from modserve.core.contracts.lora import LoRAMapping
from modserve.core.contracts.platform import GraphSettings, ModelLoad, Platform, StepForward
from modserve.core.contracts.sampler import SamplerOutput, SamplingBatch
from modserve.runner.checkpoint import CheckpointReads, as_tensor
from modserve.core.lora_request import LoRARequest
from modserve.runner.lora import LoRASlots, LoRAStep, TorchLoRAKernel, lora_mapping, mapping_rows
from modserve.runner.linear import Unquantized, default_dtype, finish_linears, linear_factory, model_bytes
from modserve.runner.loader import checkpoint_digest, checkpoint_dtype, iter_weights, load_hf_config
from modserve.runner.messages import AllocateKVCache, LoadKV, RankMessage, ReadStageTimes, RunModel
from modserve.runner.parallel import PipelineStage, RanksOutOfStep, TensorParallel
from modserve.core.plugin_calls import broke, calling, described, sampled_ids
from modserve.runner.quantization import kv_cache_dtype, select_quantizer
from modserve.core.registry import Registry
from modserve.runner.sampling import add_logprobs
from modserve.core.sequence import Sequence
from modserve.runner.rejection import verify_drafts
from modserve.core.step import ModelOutput, ScheduledStep

logger = logging.getLogger("modserve")
# SamplingParams' float settings, in SamplingBatch's order less top_k
FLOAT_SETTINGS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass(slots=True)
class ModelInput:
    """One step's forward input, and which rows of its output become tokens."""

    input_ids: torch.Tensor  # [T] int64, every sequence's new tokens back to back
    meta: AttentionMetadata
    sampled: list[Sequence]  # the step reaches their last token, no drafts: one sample each
    sample_rows: torch.Tensor  # [S] int64: the row of each one's last token
    speculating: list[Sequence]  # with drafts, verified
    spec_rows: torch.Tensor  # [R] int64: each one's rows of its last real token and of its drafts
    # Prompt logprobs: per sequence that asked and whose chunk holds prompt rows, (the prompt
    # position its first row predicts, its first row in prompt_rows, its number of rows).
    prompt_seqs: dict[Sequence, tuple[int, int, int]] = field(default_factory=dict)
    prompt_rows: torch.Tensor | None = None  # [P'] int64 rows of the hidden states scored
    prompt_targets: list[int] = field(default_factory=list)  # [P'] the prompt token each one predicts




def _join_rows(parts: list[SamplerOutput]) -> SamplerOutput | None:
    """The rows of ``parts`` in order, as one output; None when no part holds logprobs
    (nothing else is read from it). NOTE: only a step with both sampled and speculating
    sequences has two parts; a field one part lacks is zeros in its rows (none of its
    sequences asked for it, so nothing reads them)."""
    if len(parts) == 1:
        return parts[0] if parts[0].logprobs is not None else None
    if all(p.logprobs is None for p in parts):
        return None
    dev = next(p.logprobs.device for p in parts if p.logprobs is not None)
    width = max((p.top_ids.shape[1] for p in parts if p.top_ids is not None), default=0)

    def cat(name: str, dtype: torch.dtype, cols: int = 0) -> torch.Tensor:  # [rows] or [rows, cols]
        columns = []
        for p in parts:
            t, rows = getattr(p, name), p.token_ids.shape[0]
            if t is None:
                t = torch.zeros((rows, cols) if cols else rows, dtype=dtype, device=dev)
            elif cols and t.shape[1] < cols:
                t = torch.nn.functional.pad(t, (0, cols - t.shape[1]))
            columns.append(t.to(dev))
        return torch.cat(columns)

    out = SamplerOutput(cat("token_ids", torch.int64), cat("logprobs", torch.float32), cat("ranks", torch.int64))
    if width:
        out.top_ids, out.top_logprobs = cat("top_ids", torch.int64, width), cat("top_logprobs", torch.float32, width)
    return out


@dataclass(slots=True)
class StepInFlight:
    """A submitted step (:meth:`ModelRunner.submit`), until :meth:`ModelRunner.collect` samples it."""

    scheduled: ScheduledStep
    batch: ModelInput
    logits: list[torch.Tensor | None] | None  # per row set [R, vocab]; None: the last stage still sends them
    shapes: list[tuple[int, int] | None]  # each row set's logits' shape, None for an empty one


class ModelRunner:
    in_flight = False  # pipeline_in_flight at pipeline_parallel_size > 1 (set in __init__)

    def __init__(self, config: EngineConfig, hf_config: Any, registry: Registry, dtype: torch.dtype,
                 max_model_len: int, eos_token_ids: set[int], progress: bool = True,
                 platform: Platform | None = None, tp: TensorParallel = TensorParallel(),
                 pp: PipelineStage = PipelineStage()) -> None:
        self.config = config
        self.tp, self.pp = tp, pp
        # This stage's layers (all of them without pipeline parallelism); its KV cache holds only theirs.
        self.layers = pp.layers(hf_config.num_hidden_layers, config.pp_layer_partition)
        self.eos_token_ids = sorted(eos_token_ids)
        self.hf_config = hf_config
        self.platform = platform or registry.create("platform", config.platform_choice(), torch.device(config.device))
        self.device = self.platform.device  # a rank's own (Platform.device_for_rank)
        self.dtype = dtype
        self.block_size = config.block_size
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        self.attn_spec = AttentionSpec(  # this rank's heads; KV heads fewer than ranks are replicated
            num_layers=hf_config.num_hidden_layers,
            num_heads=tp.part(num_heads)[1],
            num_kv_heads=tp.part(num_kv_heads, max(1, tp.size // num_kv_heads))[1],
            head_dim=head_dim,
            scale=head_dim**-0.5,
            block_size=config.block_size,
            dtype=dtype,
            device=self.device,
            kv_cache_dtype=kv_cache_dtype(config.kv_cache_dtype, dtype),
        )
        if config.kv_cache_dtype == "auto":
            self.attn_spec.kv_cache_dtype = self.platform.auto_kv_cache_dtype(
                dtype, checkpoint_dtype(hf_config), config.dtype)
        self.attn = registry.create("attention_backend", config.attention_backend, self.attn_spec)
        if config.kv_cache_dtype == "auto" and self.attn.kv_cache_problem():  # the platform's pick: not here
            self.attn_spec.kv_cache_dtype = dtype
            self.attn = registry.create("attention_backend", config.attention_backend, self.attn_spec)
        if problem := self.attn.kv_cache_problem():
            raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype}: attention backend "
                             f"{config.attention_backend.name!r} cannot use it: {problem}")
        self.vocab_size = hf_config.vocab_size
        self.sampler = registry.create("sampler", config.sampler, self.vocab_size)
        self.logits_processors = LogitsProcessors(registry, config, self.device, self.platform.pin_memory())
        self.model = self._load_model(registry, max_model_len, progress)
        self.lora: LoRASlots | None = None
        if config.enable_lora:
            self.lora = LoRASlots(self.model, config.max_loras, config.max_lora_rank,
                                  config.max_cpu_loras or config.max_loras,
                                  self.platform.lora_kernel() or TorchLoRAKernel())
        self.connector: KVConnector | None = None
        if config.kv_connector is not None:
            layout = (f"{config.attention_backend.name}:{self.attn.kv_cache_shape(1)}:{self.attn_spec.kv_cache_dtype}:"
                      f"k{self.attn_spec.k_scale}v{self.attn_spec.v_scale}:tp{tp.size}")
            self.connector = registry.create("kv_connector", config.kv_connector, KVConnectorContext(
                config.kv_role, self.attn_spec, self.layers, f"{checkpoint_digest(config.model)}-{layout}",
                tp.rank, tp.size))
        self.kv_saves = GuardedSaves(self.connector) if self.connector is not None else None
        self.max_model_len = max_model_len
        self.kv_caches: list[torch.Tensor] = []
        self.cache_in_host_memory = self.platform.shares_host_memory()  # copies into it block (move_blocks)
        self.step_forward: StepForward = self._forward  # the platform's CUDA graphs, once the cache exists
        self._first_rows: dict[int, torch.Tensor] = {}  # n -> [n] int64 0 .. n - 1 (_row_index)
        # The step's rows kept across steps (block tables, settings); a batch in flight per stage
        self.input_batch = InputBatch(config.max_num_seqs, -(-max_model_len // self.block_size) + 1,
                                      self.block_size, self.device, depth=pp.size + 1, sent=tp.size * pp.size > 1)
        # The sampling settings' tensors of the last step's sequences, while the same ones follow,
        # and their rows with bad words of several tokens (bad_word_rows)
        self._settings: tuple[tuple[Sequence, ...], SamplingBatch, list[tuple[int, list[list[int]]]]] | None = None
        # pipeline_in_flight: rank 0 sends a step's message and runs stage 0 without waiting for
        # the later stages (they may be busy with earlier steps); its logits are taken by collect()
        self.in_flight = config.pipeline_in_flight and pp.size > 1
        self._sends: list[tuple[Any, torch.Tensor]] = []  # this rank's sends of its last step, kept alive
        self._broadcasts: deque[tuple[Any, torch.Tensor]] = deque()  # rank 0's messages not yet taken
        self.stage_seconds = 0.0  # wall time inside this stage's layers (pipeline parallel): the bubble

    def _load_model(self, registry: Registry, max_model_len: int, progress: bool) -> torch.nn.Module:
        archs = getattr(self.hf_config, "architectures", None) or []
        if not archs:
            raise ValueError("config.json names no 'architectures'")
        model_cls = registry.load("model_architecture", archs[0])
        self.quantizer = select_quantizer(self.config.quantization, self.hf_config, registry)
        float_method = self.platform.linear_method() or Unquantized()  # None: the plain F.linear
        make_linear = linear_factory(self.quantizer, self.dtype, self.device, float_method, self.tp,
                                     self.layers, registry.create("moe_backend", self.config.moe_backend),
                                     self.config.enable_expert_parallel)
        with torch.device("meta"), default_dtype(self.dtype):
            model = model_cls(self.hf_config, self.attn, max_model_len, make_linear=make_linear)
        model = model.to_empty(device=self.device)
        self.checkpoint_reads = reads = CheckpointReads()
        weights = self._weights(progress, reads)
        # A model that takes checkpoint handles reads its part of each tensor; any other, whole tensors.
        if not getattr(model, "reads_parts", False):
            weights = ((name, as_tensor(t)) for name, t in weights)
        model.load_weights(weights)
        self._log_reads(reads)
        finish_linears(model)
        # Compile or not, and weight copies in the layouts its linear method reads: the platform's.
        cfg = self.config
        finished = self.platform.finish_model(model, ModelLoad(  # LoRA's row mapping: read in an opaque op
            cfg.compile, cfg.dtype, cfg.prepack_weights, self.dtype,
            checkpoint_dtype(self.hf_config),
            self.quantizer is not None, self.quantizer is not None and self.quantizer.traceable()))
        self.compiled = finished.compiled
        self.weight_bytes = model_bytes(model)
        self.decode_weight_bytes = finished.decode_weight_bytes or self.weight_bytes  # what a decode step reads
        self.packed_weight_bytes = finished.packed_weight_bytes
        logger.info("weights: %.1f MiB (%s)%s%s", self.weight_bytes / 2**20,
                    type(self.quantizer).__name__ if self.quantizer else
                    " and ".join(sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})),
                    f", of which batch-1 decode reads {self.decode_weight_bytes / 2**20:.1f} MiB"
                    if finished.decode_weight_bytes is not None else "",
                    f"; plus {self.packed_weight_bytes / 2**20:.1f} MiB packed for batched GEMMs"
                    if self.packed_weight_bytes else "")
        if self.compiled:
            logger.info("compile: the layers' ops around attention are compiled (torch.compile, inductor)")
        return model.eval()

    def _log_reads(self, reads: CheckpointReads) -> None:
        """One line per rank, all logged by rank 0 (the others' counts gathered; workers log
        nothing of their own): what each read of the checkpoint."""
        rows = self.tp.all_ranks([reads.read, reads.size])
        if len(rows) > 1 and not self.tp.driver:
            return
        first = self.pp.index * self.tp.size + self.tp.rank if len(rows) == 1 else 0
        for rank, (read, size) in enumerate(rows, first):
            logger.info("rank %d read %.1f MiB of the checkpoint's %.1f MiB (%.0f%%)", rank, read / 2**20,
                        size / 2**20, 100 * read / max(size, 1))

    def _weights(self, progress: bool, reads: CheckpointReads):
        """The checkpoint's tensors (unread handles), less the KV cache scales (``*.k_scale``,
        ``*.v_scale``): one scale per cache tensor, so the largest over the layers (none clip)."""
        scales: dict[str, list[float]] = {"k_scale": [], "v_scale": []}
        for name, tensor in iter_weights(self.config.model, progress=progress, reads=reads):
            kind = name.rpartition(".")[2]
            if kind in scales:
                scales[kind].append(float(as_tensor(tensor).float().max()))
                continue
            yield name, tensor
        if self.attn_spec.kv_cache_dtype.itemsize == 1 and scales["k_scale"]:  # an fp8 cache's scales
            self.attn_spec.k_scale, self.attn_spec.v_scale = max(scales["k_scale"]), max(scales["v_scale"])
            logger.info("KV cache scales from the checkpoint: k %g, v %g",
                        self.attn_spec.k_scale, self.attn_spec.v_scale)

    def expert_load(self) -> dict[int, list[int]]:
        """Mixture-of-experts models: tokens routed to each expert so far, per layer of this
        stage (a model's ``expert_tokens`` buffers, ``[E]`` each); empty for a dense model."""
        return {int(re.search(r"\d+", name)[0]): buf.tolist() for name, buf in self.model.named_buffers()
                if name.endswith("expert_tokens") and re.search(r"\d+", name)}

    # -- KV cache -----------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        shape = self.attn.kv_cache_shape(1)
        return int(np.prod(shape)) * self.attn_spec.kv_cache_dtype.itemsize * len(self.layers)

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.on_every_rank(AllocateKVCache(num_blocks, num_host_blocks))

    def _allocate_kv_cache(self, message: AllocateKVCache) -> None:
        num_blocks, num_host_blocks = message.num_blocks, message.num_host_blocks
        # Zeroed once: masked-out slots must hold finite values (0 * NaN would poison attention).
        shape = self.attn.kv_cache_shape(num_blocks)
        kv_dtype = self.attn_spec.kv_cache_dtype
        self.kv_caches = [torch.zeros(shape if i in self.layers else 0, dtype=kv_dtype, device=self.device)
                          for i in range(self.attn_spec.num_layers)]  # another stage's layers: empty
        if self.connector is not None:
            with calling(self.connector, "kv_connector", "register_kv_caches()"):
                self.connector.register_kv_caches(self.kv_caches)
        host_shape = self.attn.kv_cache_shape(num_host_blocks)
        pin = self.platform.pin_memory()
        self.host_caches = [torch.zeros(host_shape if i in self.layers else 0, dtype=kv_dtype, pin_memory=pin)
                            for i in range(self.attn_spec.num_layers)] if num_host_blocks else []
        # A pipeline stage's forward takes the previous stage's hidden states, LoRA's its rows' slots: eager
        if self.pp.size == 1 and self.lora is None:
            cfg = self.config
            sizes = None if cfg.cuda_graph_sizes is None else tuple(cfg.cuda_graph_sizes)
            self.step_forward = self.platform.capture_graphs(self._forward, self.attn, GraphSettings(
                sizes, cfg.attention_backend.name, cfg.max_num_seqs, self.max_model_len, self.block_size, self.model,
                tuple(self.kv_caches)))

    @torch.inference_mode()
    def move_blocks(self, copies: list[tuple[int, int]], swap_out: list[tuple[int, int]],
                    swap_in: list[tuple[int, int]]) -> None:
        """Block moves a step needs before its forward, in this order: device to host
        (a freed block may be reused this step), device to device (copy-on-write),
        host to device."""
        # Not non_blocking into host memory: that copy returns before its bytes land, and
        # the host-side index_put below would read them early.
        into_device = not self.cache_in_host_memory
        for pairs, src_caches, dst_caches, non_blocking in ((swap_out, self.kv_caches, self.host_caches, False),
                                                             (copies, self.kv_caches, self.kv_caches, into_device),
                                                             (swap_in, self.host_caches, self.kv_caches, into_device)):
            if not pairs:
                continue
            src = torch.tensor([p[0] for p in pairs], device=src_caches[0].device)
            dst = torch.tensor([p[1] for p in pairs], device=dst_caches[0].device)
            for i in self.layers:
                dst_caches[i][:, dst] = src_caches[i][:, src].to(dst_caches[i].device, non_blocking=non_blocking)

    # -- one step -------------------------------------------------------------------
    def execute(self, scheduled: ScheduledStep) -> ModelOutput:
        """Run one scheduled step: its block moves, then the model on each sequence's
        scheduled tokens (its drafts last); sample for the sequences whose last token the
        step reaches, and verify the drafts of those that speculate."""
        return self.collect(self.submit(scheduled))

    @torch.inference_mode()
    def submit(self, scheduled: ScheduledStep) -> StepInFlight:
        """A step's tensor work on every rank, up to its logits: with ``in_flight``, rank 0 has
        sent the message and run stage 0 when this returns, the later stages still at work."""
        batch = self._prepare(scheduled.seqs, scheduled.num_new_tokens, scheduled.draft_tokens)
        saves = [t for ts in scheduled.kv_saves.values() for t in ts]
        rows = [batch.sample_rows, batch.spec_rows, batch.prompt_rows]
        logits = self.on_every_rank(RunModel(batch.input_ids, batch.meta, rows, scheduled.copies,
                                             scheduled.swap_out, scheduled.swap_in, saves,
                                             self._lora_step(scheduled.seqs, scheduled.num_new_tokens)))
        return StepInFlight(scheduled, batch, logits if self.pp.size == 1 else None,
                            [(r.numel(), self.vocab_size) if r.numel() else None for r in rows])

    def take_logits(self, step: StepInFlight) -> list[torch.Tensor | None]:
        """The step's logits ``[R, vocab]`` per row set: from the last stage when it sends them."""
        if step.logits is None:
            step.logits = self.pp.logits_from_last(step.shapes, torch.float32, self.device)
        return step.logits

    @torch.inference_mode()
    def collect(self, step: StepInFlight) -> ModelOutput:
        """Sample a submitted step (steps are collected in the order they were submitted)."""
        batch, scheduled, logits = step.batch, step.scheduled, self.take_logits(step)
        out, parts = ModelOutput(), []
        if batch.sampled:
            seqs, samples, tokens = self._sample(batch.sampled, logits[0])
            out.token_ids = {s: [t] for s, t in zip(seqs, tokens)}
            parts.append(samples)
        if batch.speculating:
            seqs = batch.speculating
            tokens, samples = verify_drafts(self, seqs, [scheduled.draft_tokens[s] for s in seqs],
                                            [scheduled.draft_probs.get(s) for s in seqs], logits[1])
            out.token_ids.update(zip(seqs, tokens))
            parts.append(samples)
        out.samples = _join_rows(parts)
        if batch.prompt_seqs:
            out.prompt_seqs, out.prompt_samples = batch.prompt_seqs, self._prompt_logprobs(logits[2], batch)
        return out

    @torch.inference_mode()
    def _run_model(self, step: RunModel) -> list[torch.Tensor | None]:
        """The step's tensor work, on every rank: block moves, the forward (saving the KV
        connector's blocks as each layer writes them), then the logits ``[R, vocab]`` of
        each set of rows (None for an empty one)."""
        if step.copies or step.swap_out or step.swap_in:
            self.move_blocks(step.copies, step.swap_out, step.swap_in)
        mapping = self.lora.activate(step.lora) if self.lora is not None else None  # every stage's adapters in slots
        if self.pp.size > 1:
            return self._run_stage(step.input_ids, step.meta, step.logit_rows, mapping)
        input_ids, meta, kv_saves = step.input_ids, step.meta, step.kv_saves
        with lora_mapping(mapping):
            # [T, hidden]; a step that saves runs eagerly: a CUDA graph would not replay the saves
            hidden = self._saving_forward(input_ids, meta, kv_saves) if kv_saves else self.step_forward(input_ids, meta)
        every_row = self._first_rows.get(hidden.shape[0])  # a step of decodes samples every row: no gather
        return [self.model.compute_logits(hidden if rows is every_row else hidden[rows]) if rows.numel() else None
                for rows in step.logit_rows]

    def _run_stage(self, input_ids: torch.Tensor, meta: AttentionMetadata, logit_rows: list[torch.Tensor],
                   mapping: LoRAMapping | None = None) -> list[torch.Tensor | None]:
        """This pipeline stage's part of a step: its micro-batches one after another, each the
        previous stage's hidden states in, this stage's layers, out to the next (sent without
        waiting: the next micro-batch, or the next step, starts meanwhile). The last stage's
        logits (float32) go to rank 0, which samples (:meth:`take_logits`): the last stage's
        ranks return their own, the other ranks nothing."""
        pp = self.pp
        count = micro_batch_count(self.config.pipeline_micro_batches, pp.size, meta.num_tokens)
        parts = split_batch(input_ids, meta, logit_rows, count)
        sends, logits = [], []
        first_row = 0
        for ids, part_meta, rows in parts:
            like = torch.empty(ids.shape[0], self.hf_config.hidden_size, dtype=self.dtype, device=self.device)
            prev = None if pp.first else pp.recv_prev(like)
            start = time.perf_counter()
            with lora_mapping(mapping_rows(mapping, first_row, first_row + ids.shape[0])):
                hidden = self._forward(ids, part_meta, prev)
            first_row += ids.shape[0]
            if pp.last:
                logits.append([self.model.compute_logits(hidden[r]).float() if r.numel() else None for r in rows])
            self.stage_seconds += time.perf_counter() - start
            if not pp.last:
                sends.append(pp.send_next(hidden))  # (work, tensor): the tensor lives until its send is done
        if pp.last:
            logits = [torch.cat([p[i] for p in logits if p[i] is not None]) if logit_rows[i].numel() else None
                      for i in range(len(logit_rows))]
            if self.tp.rank == 0:
                sends.extend(pp.logits_to_rank0(logits))
        # NOTE: the last step's sends are waited for only now: gloo's send returns once the
        # receiver takes it, and the next stage may still be busy with an earlier step.
        for work, _ in self._sends:
            work.wait()
        self._sends = sends
        return logits if pp.last else []

    def _saving_forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                        kv_saves: list[BlockTransfer]) -> torch.Tensor:  # [T, hidden]
        """The forward, the KV connector saving ``kv_saves`` from each layer as it is written
        (a save that fails is skipped and counted: kv_saves.py)."""
        with after_each_layer(self.kv_saves.layer_hook(kv_saves)):
            hidden = self._forward(input_ids, meta)
        self.kv_saves.finish()
        return hidden

    def connector_stats(self) -> dict[str, float]:
        """The KV connector's counters, and this rank's steps whose saves failed."""
        return {**self.connector.stats(), "save_failures": self.kv_saves.failures}

    def load_kv(self, transfers: list[BlockTransfer]) -> list[int]:
        """The KV connector loads these blocks on every rank; the indices of those that
        failed on any rank (in order), which all ranks then drop."""
        return self.on_every_rank(LoadKV(transfers))

    @torch.inference_mode()
    def _load_kv(self, message: LoadKV) -> list[int]:
        transfers, connector = message.transfers, self.connector
        with calling(connector, "kv_connector", "load()"):
            failed = connector.load(transfers)
        if not isinstance(failed, list) or not all(isinstance(i, int) and 0 <= i < len(transfers) for i in failed):
            raise broke(connector, "kv_connector", "load()", f"a list of indices in [0, {len(transfers)})",
                        described(failed))
        if self.tp.size > 1:  # a block one rank could not load is lost to every rank
            flags = torch.zeros(len(transfers), device=self.device)
            flags[failed] = 1.0
            failed = self.tp.all_reduce(flags).nonzero().flatten().tolist()
        return sorted(set(failed))

    def _read_stage_times(self, message: ReadStageTimes) -> list[list[int]]:
        return self.tp.all_ranks([round(self.stage_seconds * 1e9)])  # every rank's, in ns

    # -- what ranks > 0 can be asked to do (messages.py) ---------------------------------
    # Each message and what every rank runs for it; Stop ends a worker's loop instead.
    HANDLERS: ClassVar[dict[type, Callable[[ModelRunner, Any], Any]]] = {
        AllocateKVCache: _allocate_kv_cache,
        RunModel: _run_model,
        LoadKV: _load_kv,
        ReadStageTimes: _read_stage_times,
    }

    def stage_times(self) -> list[float]:
        """Seconds each rank (by global rank) spent inside its stage's layers so far: a stage's
        busy time; over the wall time, 1 minus it is the stage's idle fraction (the bubble)."""
        return [ns / 1e9 for ns, in self.on_every_rank(ReadStageTimes())]

    def on_every_rank(self, message: RankMessage) -> Any:
        """Carry out ``message`` on every rank: rank 0 sends it to the others first (one broadcast)."""
        handler = self._handler(message)
        if self.tp.size * self.pp.size == 1 or not self.tp.driver:
            return handler(self, message)
        if self.in_flight:  # the later stages may be busy with earlier steps: don't wait for them
            while self._broadcasts and self._broadcasts[0][0].is_completed():
                self._broadcasts.popleft()
            self._broadcasts.extend(self.tp.broadcast_async(message))
        else:
            self.tp.broadcast(message)
        try:
            return handler(self, message)
        except Exception as e:  # the others may wait in a collective rank 0 never reaches: no retry
            raise RanksOutOfStep(f"rank 0 failed in {handler.__name__.lstrip('_')} while the other ranks ran "
                                 f"it: {type(e).__name__}: {e}") from e

    def handle(self, message: RankMessage) -> Any:
        """Carry out one message on this rank alone (a rank > 0: each one rank 0 sends)."""
        return self._handler(message)(self, message)

    def _handler(self, message: RankMessage) -> Callable[[ModelRunner, Any], Any]:
        handler = self.HANDLERS.get(type(message))
        if handler is None:
            raise TypeError(f"a rank cannot be asked to {type(message).__name__}: the messages it "
                            f"handles are {', '.join(t.__name__ for t in self.HANDLERS)}")
        return handler

    def close(self) -> None:
        """The engine stops: the KV connector lets go of what it holds."""
        if self.connector is not None:
            with calling(self.connector, "kv_connector", "close()"):
                self.connector.close()
            self.connector = None

    def _prompt_logprobs(self, logits: torch.Tensor, batch: ModelInput) -> SamplerOutput:
        """Log-softmax (float32, of the raw logits) at every prompt row, read at the next
        prompt token, and the top N; the rows of sequences that asked, no others."""
        raw = logits.float().log_softmax(dim=-1)  # [P', V]
        out = SamplerOutput(torch.tensor(batch.prompt_targets, dtype=torch.int64, device=self.device))
        add_logprobs(out, raw, max(s.params.prompt_logprobs for s in batch.prompt_seqs))
        # One copy to the host: the engine reads them entry by entry.
        return SamplerOutput(*(t if t is None else t.cpu() for t in
                               (out.token_ids, out.logprobs, out.ranks, out.top_ids, out.top_logprobs)))

    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                 hidden_states: torch.Tensor | None = None) -> torch.Tensor:  # [T, hidden]
        with calling(self.attn, "attention_backend", "prepare()"):
            state = self.attn.prepare(meta)
        if self.pp.size == 1:
            return self.model(input_ids, meta.positions, self.kv_caches, meta, state)
        return self.model(input_ids, meta.positions, self.kv_caches, meta, state, hidden_states=hidden_states)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], SamplerOutput, list[int]]:
        """One token per sequence, and one for each sample (n > 1) that forks from it: the
        sequences, the sampler's output and its token ids (checked)."""
        if any(s.pending_forks for s in seqs):
            # n > 1: the prompt was computed once; every sample draws from its logits.
            repeats = torch.tensor([1 + len(s.pending_forks) for s in seqs], device=logits.device)
            logits = logits.repeat_interleave(repeats, dim=0)
            seqs = [x for s in seqs for x in (s, *s.pending_forks)]
        batch = self.sampling_batch(seqs)
        with calling(self.sampler, "sampler", "__call__()"):
            out = self.sampler(logits, batch)
        return seqs, out, sampled_ids(self.sampler, out, len(seqs), self.vocab_size)

    def _prepare(self, seqs: list[Sequence], num_new_tokens: list[int],
                 draft_tokens: dict[Sequence, list[int]] | None = None) -> ModelInput:
        drafts = draft_tokens or {}
        ctx = [s.num_computed_tokens for s in seqs]
        # A speculating sequence computes its last real token, then its drafts.
        chunks = [s.token_ids[c : c + n] if s not in drafts else s.token_ids[c : c + n - len(drafts[s])] + drafts[s]
                  for s, c, n in zip(seqs, ctx, num_new_tokens)]
        input_ids, meta = self.input_batch.prepare(seqs, chunks, ctx, [len(c) for c in chunks] if drafts
                                                   else num_new_tokens)
        ends = list(itertools.accumulate(num_new_tokens))
        sampled, sample_rows, speculating, spec_rows = [], [], [], []
        prompt_seqs, prompt_rows, prompt_targets = {}, [], []
        for s, c, n, end in zip(seqs, ctx, num_new_tokens, ends):
            if s.params.prompt_logprobs is not None and c < s.num_prompt_tokens - 1:
                # Position p's logits predict token p + 1: the chunk's rows up to the prompt's
                # second-to-last position (the last one's is the first sample); a chunk's last
                # row predicts the first token of the next chunk.
                k = min(c + n, s.num_prompt_tokens - 1) - c
                prompt_seqs[s] = (c + 1, len(prompt_rows), k)
                prompt_rows.extend(range(end - n, end - n + k))
                prompt_targets.extend(s.token_ids[c + 1 : c + 1 + k])
            if s in drafts:  # logits of the last real token and of every draft
                speculating.append(s)
                spec_rows.extend(range(end - 1 - len(drafts[s]), end))
            elif c + n == s.num_tokens:  # only a sequence whose last token is reached gets a sample
                sampled.append(s)
                sample_rows.append(end - 1)
        as_index = self._row_index
        return ModelInput(input_ids, meta, sampled, as_index(sample_rows), speculating, as_index(spec_rows),
                          prompt_seqs, as_index(prompt_rows), prompt_targets)

    def check_lora(self, request: LoRARequest | None) -> None:
        """A ValueError if ``request`` (an adapter or None) cannot run here; its weights cached if it can."""
        if request is not None and self.lora is None:
            raise ValueError(f"LoRA adapter {request.lora_name!r} requested, but LoRA is not enabled "
                             "(enable_lora / --enable-lora)")
        if request is not None:
            self.lora.adapter(request)

    def _lora_step(self, seqs: list[Sequence], num_new_tokens: list[int]) -> LoRAStep | None:
        """Each adapter of the step's sequences and its rows (each sequence's ``n`` new ones, back to back)."""
        if self.lora is None:
            return None
        rows: dict[LoRARequest, list[int]] = {}
        start = 0
        for s, n in zip(seqs, num_new_tokens):
            if s.lora_request is not None:
                rows.setdefault(s.lora_request, []).extend(range(start, start + n))
            start += n
        return LoRAStep(list(rows), list(rows.values()), start) if rows else None

    def _row_index(self, rows: list[int]) -> torch.Tensor:  # [len(rows)] int64
        """``rows`` (increasing) on the device; ``0 .. n - 1`` (every sequence of a step of
        decodes samples) and none are made once per size and shared, as nothing writes them."""
        n = len(rows)
        if n > self.config.max_num_seqs or (rows and rows[-1] != n - 1):
            return torch.tensor(rows, dtype=torch.int64, device=self.device)
        if n not in self._first_rows:
            self._first_rows[n] = torch.arange(n, dtype=torch.int64, device=self.device)
        return self._first_rows[n]

    # -- a second model beside the target (a proposer's draft) --------------------------
    @torch.inference_mode()
    def last_token_logits(self, seqs: list[Sequence], chunks: list[list[int]],
                          context_lens: list[int]) -> torch.Tensor:
        """Run the model on ``chunks[i]``, the tokens of ``seqs[i]`` from position
        ``context_lens[i]`` on, writing their KV into this runner's cache at the sequence's
        blocks; return the logits [B, V] at each chunk's last token. What a draft model
        made by ``ProposerContext.load_model`` runs: its own KV, the target's block tables."""
        input_ids, meta = build_batch(chunks, context_lens, [s.block_ids for s in seqs], self.block_size,
                                      self.device)
        hidden = self._forward(input_ids, meta)  # [T, hidden]
        return self.model.compute_logits(hidden[meta.query_start_loc[1:] - 1])  # [B, V]

    def sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """The sampler's settings for ``seqs``, one row each. What stays with a sequence (its
        SamplingParams, its generator) is the last call's tensors again while the sequences are
        the same (samplers only read them): made each step, they cost ~0.1 ms of a decode step."""
        plain = self.input_batch.plain(seqs)  # the batch's rows, none with per-step rules: no pass over them
        if self._settings is None or self._settings[0] != tuple(seqs):
            rows = self.input_batch.sampling_settings() if plain else self._row_settings(seqs)
            self._settings = (tuple(seqs), rows, [] if plain else bad_word_rows(seqs))
        _, rows, word_rows = self._settings
        processors = self.logits_processors
        if plain and not rows.any_penalty and not processors:  # nothing read per step: the rows' batch as it is
            return rows
        banned = [] if plain else [(row, list(s.params.stop_token_ids) + self.eos_token_ids)
                                   for row, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
        banned += bad_word_bans(seqs, word_rows)  # looks only at rows with bad words of several tokens
        prompt = output = None
        if rows.any_penalty:
            prompt = self._padded([s.prompt_token_ids for s in seqs])
            output = self._padded([s.output_token_ids for s in seqs])
        grammar = None if plain else fill_token_bitmask(seqs, self.vocab_size, self.device)
        if processors:  # none configured: not a call more
            processors.update(seqs)
        return dataclasses.replace(rows, prompt_token_ids=prompt, output_token_ids=output, banned_token_ids=banned,
                                   allowed_token_bitmask=joined_bitmask(rows.allowed_token_bitmask, grammar),
                                   logits_processors=processors.others,
                                   argmax_invariant_processors=processors.argmax_invariant)

    def _row_settings(self, seqs: list[Sequence]) -> SamplingBatch:
        """The settings that stay with each sequence, as a SamplingBatch without this step's
        penalty token ids, bans and grammar mask; allowed_token_bitmask holds the rows' own
        token rules (allowed_token_ids, one-token bad_words), None when no row has any."""
        params = [s.params for s in seqs]
        # one [6, B] float32 tensor, a row per setting: one call, not six
        temperature, top_p, min_p, repetition, presence, frequency = torch.tensor(
            [[getattr(p, name) for p in params] for name in FLOAT_SETTINGS], dtype=torch.float32, device=self.device)
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        want = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingBatch(
            temperature, torch.tensor(top_k, dtype=torch.int64, device=self.device), top_p, min_p, repetition, presence,
            frequency, all_greedy=all(p.temperature == 0.0 for p in params), any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p.top_p < 1.0 for p in params), any_min_p=any(p.min_p > 0.0 for p in params),
            any_penalty=any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params),
            generators={i: s.generator for i, s in enumerate(seqs) if s.generator is not None},
            prompt_token_ids=None, output_token_ids=None, banned_token_ids=[],
            max_num_logprobs=max(want) if want else -1,
            allowed_token_bitmask=token_rule_bitmask(seqs, self.vocab_size, self.device),
            logit_bias=logit_bias_entries(seqs, self.device))

    def _padded(self, rows: list[list[int]]) -> torch.Tensor:
        width = max((len(r) for r in rows), default=0)
        out = np.full((len(rows), max(width, 1)), self.vocab_size, dtype=np.int64)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return torch.from_numpy(out).to(self.device)


def load_draft(model: str, *, config: EngineConfig, registry: Registry, dtype: torch.dtype, num_blocks: int,
               max_model_len: int, vocab_size: int) -> ModelRunner:
    """What :attr:`ProposerContext.load_model` gives a proposer: a second checkpoint sharing the
    target's tokenizer, on the target's device and dtype, with KV tensors of its own for
    ``num_blocks`` blocks (indexed by the target's block tables)."""
    hf_config = load_hf_config(model)
    if hf_config.vocab_size != vocab_size:
        raise ValueError(f"draft vocab_size {hf_config.vocab_size} differs from the target's "
                         f"{vocab_size}: the draft must share the tokenizer")
    # No CUDA graphs: a draft runs its own forward, never the captured step.
    config = config.model_copy(update={"model": model, "quantization": None, "cuda_graph_sizes": []})
    runner = ModelRunner(config, hf_config, registry, dtype, max_model_len, set(), progress=False)
    runner.allocate_kv_cache(num_blocks)
    return runner
