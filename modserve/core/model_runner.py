"""Turns a scheduled step into one forward pass and one sampling call."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from modserve.core.batch import build_batch
from modserve.core.compile import (add_decode_weights, checkpoint_dtype, compile_wanted, decode_weight_dtype,
                                   regions_compiled)
from modserve.core.prepack import add_packed_weights, prepack_wanted
from modserve.core.config import EngineConfig
from modserve.core.grammar import fill_token_bitmask
from modserve.core.interfaces import AttentionSpec, SamplerOutput, SamplingBatch
from modserve.core.linear import default_dtype, finish_linears, linear_factory, model_bytes
from modserve.core.loader import iter_weights
from modserve.core.quantization import kv_cache_dtype, select_quantizer
from modserve.core.registry import Registry
from modserve.core.sequence import Sequence
from modserve.core.speculative import verify

logger = logging.getLogger("modserve")


@dataclass(slots=True)
class StepOutput:
    sampled: list[Sequence] = field(default_factory=list)  # one new token each
    samples: SamplerOutput | None = None
    spec_seqs: list[Sequence] = field(default_factory=list)  # several new tokens each
    spec_tokens: list[list[int]] = field(default_factory=list)  # accepted drafts + one more
    spec_samples: SamplerOutput | None = None  # one row per emitted spec token, in order


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: Any, registry: Registry, dtype: torch.dtype,
                 max_model_len: int, eos_token_ids: set[int], progress: bool = True) -> None:
        self.config = config
        self.eos_token_ids = sorted(eos_token_ids)
        self.hf_config = hf_config
        self.device = torch.device(config.device)
        self.dtype = dtype
        self.block_size = config.block_size
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        self.attn_spec = AttentionSpec(
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            scale=head_dim**-0.5,
            block_size=config.block_size,
            dtype=dtype,
            device=self.device,
            kv_cache_dtype=kv_cache_dtype(config.kv_cache_dtype, dtype),
        )
        self.attn = registry.create("attention_backend", config.attention_backend, self.attn_spec)
        if problem := self.attn.kv_cache_problem():
            raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype}: attention backend "
                             f"{config.attention_backend.name!r} cannot use it: {problem}")
        self.vocab_size = hf_config.vocab_size
        self.sampler = registry.create("sampler", config.sampler, self.vocab_size)
        self.model = self._load_model(registry, max_model_len, progress)
        self.kv_caches: list[torch.Tensor] = []

    def _load_model(self, registry: Registry, max_model_len: int, progress: bool) -> torch.nn.Module:
        archs = getattr(self.hf_config, "architectures", None) or []
        if not archs:
            raise ValueError("config.json names no 'architectures'")
        model_cls = registry.load("model_architecture", archs[0])
        self.quantizer = select_quantizer(self.config.quantization, self.hf_config, registry)
        make_linear = linear_factory(self.quantizer, self.dtype, self.device)
        with torch.device("meta"), default_dtype(self.dtype):
            model = model_cls(self.hf_config, self.attn, max_model_len, make_linear=make_linear)
        model = model.to_empty(device=self.device)
        model.load_weights(self._weights(progress))
        finish_linears(model)
        self.decode_weight_bytes = model_bytes(model)  # what a decode step reads
        self.compiled = compile_wanted(self.config.compile, self.device, self.decode_weight_bytes,
                                       self.quantizer is not None) \
            and regions_compiled(model)
        decode_dtype = decode_weight_dtype(self.config.dtype, self.dtype, checkpoint_dtype(self.hf_config),
                                           self.device, self.compiled)
        if decode_dtype is not None:
            self.decode_weight_bytes = add_decode_weights(model, decode_dtype)
        self.weight_bytes = model_bytes(model)
        self.packed_weight_bytes = 0
        if prepack_wanted(self.config.prepack_weights, self.device, self.dtype, self.weight_bytes,
                          self.quantizer is not None):
            self.packed_weight_bytes = add_packed_weights(model)
        logger.info("weights: %.1f MiB (%s)%s%s", self.weight_bytes / 2**20,
                    type(self.quantizer).__name__ if self.quantizer else str(self.dtype).removeprefix("torch."),
                    f", of which batch-1 decode reads {self.decode_weight_bytes / 2**20:.1f} MiB"
                    if decode_dtype is not None else "",
                    f"; plus {self.packed_weight_bytes / 2**20:.1f} MiB packed for batched GEMMs"
                    if self.packed_weight_bytes else "")
        if self.compiled:
            logger.info("compile: the layers' ops around attention are compiled (torch.compile, inductor)")
        return model.eval()

    def _weights(self, progress: bool):
        """The checkpoint's tensors, less the KV cache scales (``*.k_scale``, ``*.v_scale``): one
        scale per cache tensor, so the largest over the layers (none clip)."""
        scales: dict[str, list[float]] = {"k_scale": [], "v_scale": []}
        for name, tensor in iter_weights(self.config.model, progress=progress):
            kind = name.rpartition(".")[2]
            if kind in scales:
                scales[kind].append(float(tensor.float().max()))
                continue
            yield name, tensor
        if self.attn_spec.kv_cache_dtype != self.dtype and scales["k_scale"]:
            self.attn_spec.k_scale, self.attn_spec.v_scale = max(scales["k_scale"]), max(scales["v_scale"])
            logger.info("KV cache scales from the checkpoint: k %g, v %g",
                        self.attn_spec.k_scale, self.attn_spec.v_scale)

    # -- KV cache -----------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        shape = self.attn.kv_cache_shape(1)
        return int(np.prod(shape)) * self.attn_spec.kv_cache_dtype.itemsize * self.attn_spec.num_layers

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        # Zeroed once: masked-out slots must hold finite values (0 * NaN would poison attention).
        shape = self.attn.kv_cache_shape(num_blocks)
        kv_dtype = self.attn_spec.kv_cache_dtype
        self.kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=self.device)
                          for _ in range(self.attn_spec.num_layers)]
        host_shape = self.attn.kv_cache_shape(num_host_blocks)
        pin = self.device.type == "cuda"
        self.host_caches = [torch.zeros(host_shape, dtype=kv_dtype, pin_memory=pin)
                            for _ in range(self.attn_spec.num_layers)] if num_host_blocks else []

    @torch.inference_mode()
    def move_blocks(self, copies: list[tuple[int, int]], swap_out: list[tuple[int, int]],
                    swap_in: list[tuple[int, int]]) -> None:
        """Block moves a step needs before its forward, in this order: device to host
        (a freed block may be reused this step), device to device (copy-on-write),
        host to device."""
        for pairs, src_caches, dst_caches in ((swap_out, self.kv_caches, self.host_caches),
                                               (copies, self.kv_caches, self.kv_caches),
                                               (swap_in, self.host_caches, self.kv_caches)):
            if not pairs:
                continue
            src = torch.tensor([p[0] for p in pairs], device=src_caches[0].device)
            dst = torch.tensor([p[1] for p in pairs], device=dst_caches[0].device)
            # Not non_blocking into host memory: that copy returns before its bytes land, and
            # the host-side index_put below would read them early.
            to_device = dst_caches[0].device.type != "cpu"
            for s_cache, d_cache in zip(src_caches, dst_caches):
                d_cache[:, dst] = s_cache[:, src].to(d_cache.device, non_blocking=to_device)

    # -- one step -------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], num_new_tokens: list[int]) -> StepOutput:
        """Run the model on each sequence's next ``num_new_tokens`` tokens (its draft
        tokens last, if it has any); sample for the sequences whose last token this step
        reaches, and verify the drafts of those that speculate."""
        input_ids, meta, rows, sampled, spec, spec_rows = self._prepare(seqs, num_new_tokens)
        state = self.attn.prepare(meta)
        hidden = self.model(input_ids, meta.positions, self.kv_caches, meta, state)  # [T, hidden]
        step = StepOutput()
        if sampled:
            logits = self.model.compute_logits(hidden[rows])  # [S, vocab]
            if any(s.pending_forks for s in sampled):
                # n > 1: the prompt was computed once; every sample draws from its logits.
                repeats = torch.tensor([1 + len(s.pending_forks) for s in sampled], device=logits.device)
                logits = logits.repeat_interleave(repeats, dim=0)
                sampled = [x for s in sampled for x in (s, *s.pending_forks)]
            step.sampled, step.samples = sampled, self.sampler(logits, self._sampling_batch(sampled))
        if spec:
            step.spec_seqs = spec
            step.spec_tokens, step.spec_samples = self._verify(spec, self.model.compute_logits(hidden[spec_rows]))
        return step

    def _prepare(self, seqs: list[Sequence], num_new_tokens: list[int]):
        ctx = [s.num_computed_tokens for s in seqs]
        # A speculating sequence computes its last real token, then its drafts.
        chunks = [s.token_ids[c : c + n - len(s.spec_tokens)] + s.spec_tokens
                  for s, c, n in zip(seqs, ctx, num_new_tokens)]
        input_ids, meta = build_batch(chunks, ctx, [s.block_ids for s in seqs], self.block_size, self.device)
        ends = list(itertools.accumulate(num_new_tokens))
        sampled, rows, spec, spec_rows = [], [], [], []
        for s, c, n, end in zip(seqs, ctx, num_new_tokens, ends):
            if s.spec_tokens:  # logits of the last real token and of every draft
                spec.append(s)
                spec_rows.extend(range(end - 1 - len(s.spec_tokens), end))
            elif c + n == s.num_tokens:  # only a sequence whose last token is reached gets a sample
                sampled.append(s)
                rows.append(end - 1)
        as_index = lambda r: torch.tensor(r, dtype=torch.int64, device=self.device)  # noqa: E731
        return input_ids, meta, as_index(rows), sampled, spec, as_index(spec_rows)

    def _verify(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[list[int]], SamplerOutput]:
        """Rejection-sample each sequence's drafts against the target; logits [R, V] hold,
        per sequence, the rows of its last real token and of each draft."""
        counts = [1 + len(s.spec_tokens) for s in seqs]
        K = max(counts) - 1
        starts = [0, *itertools.accumulate(counts)][:-1]
        # Each row's processed distribution, with its sequence's settings.
        rep = self._sampling_batch([s for s, c in zip(seqs, counts) for _ in range(c)])
        if rep.allowed_token_bitmask is not None:
            rep.allowed_token_bitmask = self._draft_bitmask(seqs, starts, sum(counts))
        probs = self.sampler.probs(logits, rep)
        pos = torch.tensor([[st + min(j, c - 1) for j in range(K + 1)] for st, c in zip(starts, counts)],
                           device=self.device)  # [B, K+1] rows, the last repeated as padding
        drafts = torch.tensor([s.spec_tokens + [0] * (K - len(s.spec_tokens)) for s in seqs], device=self.device)
        q = None
        if any(s.spec_probs is not None for s in seqs):
            q = torch.zeros(len(seqs), K, probs.shape[1], device=self.device)  # [B, K, V]
            for b, s in enumerate(seqs):
                q[b, : len(s.spec_tokens)] = s.spec_probs if s.spec_probs is not None else \
                    torch.nn.functional.one_hot(torch.tensor(s.spec_tokens, device=self.device), probs.shape[1])
        batch = self._sampling_batch(seqs)
        verified = verify(probs[pos], drafts, [c - 1 for c in counts], q, batch.temperature == 0, batch.generators)
        # Per emitted token, the raw logprobs of the row it was drawn from.
        emitted = [st + j for st, toks in zip(starts, verified.token_ids) for j in range(len(toks))]
        out = SamplerOutput(token_ids=torch.tensor([t for toks in verified.token_ids for t in toks]))
        if batch.max_num_logprobs >= 0:
            raw = logits[emitted].float().log_softmax(dim=-1)  # [E, V]
            out.logprobs = raw.gather(1, out.token_ids.unsqueeze(1).to(raw.device)).squeeze(1)
            out.ranks = (raw > out.logprobs.unsqueeze(1)).sum(dim=-1) + 1
            if batch.max_num_logprobs > 0:
                out.top_logprobs, out.top_ids = raw.topk(min(batch.max_num_logprobs, raw.shape[-1]), dim=-1)
        return verified.token_ids, out

    def _draft_bitmask(self, seqs: list[Sequence], starts: list[int], num_rows: int) -> torch.Tensor:
        """Grammar masks for verification: the row of draft position j holds the grammar
        state after the first j drafts (drafts were checked against it when proposed)."""
        mask = torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for seq, start in zip(seqs, starts):
            matcher = seq.grammar
            if matcher is None:
                continue
            for j, token in enumerate([None, *seq.spec_tokens]):
                if token is not None:
                    matcher.accept_token(token)
                if not matcher.is_terminated():  # past the end every token is dropped anyway
                    matcher.fill_bitmask(mask, start + j)
            matcher.rollback(len(seq.spec_tokens))
        return mask.to(self.device, non_blocking=True)

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        params = [s.params for s in seqs]
        dev = self.device

        def col(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        temperature = [p.temperature for p in params]
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        any_penalty = any(
            p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params
        )
        prompt_ids = output_ids = None
        if any_penalty:
            prompt_ids = self._padded([s.prompt_token_ids for s in seqs])
            output_ids = self._padded([s.output_token_ids for s in seqs])
        banned = []
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                stop_ids = list(seq.params.stop_token_ids) + self.eos_token_ids
                banned.append((row, stop_ids))
        want = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingBatch(
            temperature=col(temperature, torch.float32),
            top_k=col(top_k, torch.int64),
            top_p=col([p.top_p for p in params], torch.float32),
            min_p=col([p.min_p for p in params], torch.float32),
            repetition_penalty=col([p.repetition_penalty for p in params], torch.float32),
            presence_penalty=col([p.presence_penalty for p in params], torch.float32),
            frequency_penalty=col([p.frequency_penalty for p in params], torch.float32),
            all_greedy=all(t == 0.0 for t in temperature),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
            any_penalty=any_penalty,
            generators={i: s.generator for i, s in enumerate(seqs) if s.generator is not None},
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            banned_token_ids=banned,
            max_num_logprobs=max(want) if want else -1,
            allowed_token_bitmask=fill_token_bitmask(seqs, self.vocab_size, dev),
        )

    def _padded(self, rows: list[list[int]]) -> torch.Tensor:
        width = max((len(r) for r in rows), default=0)
        out = np.full((len(rows), max(width, 1)), self.vocab_size, dtype=np.int64)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return torch.from_numpy(out).to(self.device)
