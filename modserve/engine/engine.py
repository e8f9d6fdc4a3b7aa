"""LLMEngine: requests in, one scheduled forward pass per step, outputs out."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from collections import deque
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import torch

from modserve.core.config import EngineConfig
from modserve.engine.grammar import AUTO, GrammarCompiler, wait_any
from modserve.engine.grammar_compile import CompiledGrammar
from modserve.core.contracts.grammar_backend import GrammarMatcher
from modserve.core.contracts.platform import Platform
from modserve.core.contracts.sampler import SamplerOutput
from modserve.core.contracts.scheduler import SchedulerLimits
from modserve.runner.loader import checkpoint_dtype, load_hf_config, resolve_max_model_len
from modserve.core.step import ModelOutput
from modserve.runner.model_runner import ModelRunner
from modserve.runner.parallel import PipelineStage, RanksOutOfStep
from modserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from modserve.core.plugin_calls import calling
from modserve.core.registry import PluginError, Registry, get_registry
from modserve.core.sampling_params import SamplingParams
from modserve.core.step import ScheduledStep
from modserve.engine.scheduler import SchedulerCore, SwapSpace
from modserve.core.sequence import Sequence, SequenceStatus
from modserve.engine.spec_decode import SpecDecode
from modserve.engine.tokenizer import Tokenizer
from modserve.runner.ranks import start_ranks, stop_ranks

logger = logging.getLogger("modserve")
WORKER_EXIT_GRACE = 0.5  # seconds, see LLMEngine._worker_failure


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    max_tokens: int
    # With params.prompt_logprobs: an entry per prompt token scored so far, [None] at first.
    prompt_logprobs: list[dict[str, Any] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig, registry: Registry | None = None, progress: bool = True) -> None:
        self.config = config
        registry = registry or get_registry()
        check_plugin_choices(config, registry)  # a typo fails now, not after the weights loaded
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.platform: Platform = registry.create("platform", config.platform_choice(), torch.device(config.device))
        self.platform.prepare_process()
        torch.manual_seed(config.seed)  # unseeded requests draw from the global generator
        hf_config = load_hf_config(config.model)
        self.max_model_len = resolve_max_model_len(config, hf_config)
        # A partition that cannot be is the config's fault: say so before any worker starts.
        PipelineStage(0, config.pipeline_parallel_size).layers(hf_config.num_hidden_layers, config.pp_layer_partition)
        self.dtype = self.platform.resolve_dtype(config.dtype, checkpoint_dtype(hf_config))
        self.tokenizer = Tokenizer(config.tokenizer or config.model, config.model)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.grammar = GrammarCompiler(registry, config.grammar_backend, config.tokenizer or config.model,
                                       hf_config.vocab_size, self.eos_token_ids, config.grammar_cache_size,
                                       config.grammar_compile_workers, config.grammar_compile_timeout,
                                       config.grammar_compile_isolation, config.grammar_compile_memory_mb)
        self.compiling: dict[str, Future] = {}  # request id -> its grammar, still compiling
        self.ranks_in_step = True  # the other ranks wait for rank 0's next call (not inside one)
        self.stopped = False
        self.executor, tp, pp = start_ranks(config, registry, self.platform)
        try:
            self.runner = ModelRunner(config, hf_config, registry, self.dtype, self.max_model_len,
                                      self.eos_token_ids, progress=progress, platform=self.platform, tp=tp, pp=pp)
            self._start_kv_and_scheduler(registry)
        except Exception as e:
            # rank 0's own ValueError (the config) is the cause even when the workers, failing on
            # it too, are seen gone first
            why = None if isinstance(e, ValueError) else self._worker_failure()
            stop_ranks(self.executor, tp, config.world_size, tell=not isinstance(e, RanksOutOfStep))
            if why:
                raise EngineDeadError(f"a tensor-parallel worker failed: {why}") from e
            raise

    def _start_kv_and_scheduler(self, registry: Registry) -> None:
        config = self.config
        self.num_blocks = self._num_kv_blocks()
        num_host_blocks = self._num_swap_blocks()
        self.runner.allocate_kv_cache(self.num_blocks, num_host_blocks)
        allocator = registry.create("kv_allocator", config.kv_allocator, self.num_blocks, config.block_size,
                                    self.max_model_len)
        limits = SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        policy = registry.create("scheduler", config.scheduler, limits)
        self.scheduler = SchedulerCore(policy, allocator, limits, config.scheduler.name, config.preemption_mode,
                                       SwapSpace(num_host_blocks) if num_host_blocks else None,
                                       self.runner.connector, config.kv_role)
        self.allocator = allocator
        self.requests: dict[str, Request] = {}
        self._seq_ids = count()
        self.counters = {"prompt_tokens": 0, "computed_tokens": 0, "generation_tokens": 0, "steps": 0}
        self.isolation = StepIsolation()
        self.spec = SpecDecode.create(config, registry, self.runner, self.num_blocks, self.max_model_len)
        if self.runner.compiled:
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile now, not on the first request. Two 2-token prompts: their prefill makes the
        layers' graph for 2+ rows and the logits' graph for 2+ sequences; the second stops
        after one token, so the decode after it makes both graphs for one row."""
        start = time.perf_counter()
        logger.info("compile warm-up: torch.compile (inductor) of the layers' and logits' graphs, for one row "
                    "and for 2+ rows: ~10 s from inductor's cache, 1-2 min on 2 cores without it")
        for name, max_tokens in (("modserve-warm-up", 2), ("modserve-warm-up-2", 1)):
            self.add_request(name, [0, 0], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        graphs = ("the graphs for 2+ rows (a prefill of two prompts)", "the graphs for one row (a decode)")
        for step in count(1):
            if not self.has_unfinished_requests():
                break
            what = graphs[step - 1] if step <= len(graphs) else "another step"
            logger.info("compile warm-up %d/%d: %s ... (%.1f s so far)", step, max(step, len(graphs)), what,
                        time.perf_counter() - start)
            self.step()
        for key in self.counters:
            self.counters[key] = 0
        # NOTE: two tokens fill no KV block, so the prefix cache keeps nothing of this.
        logger.info("compile: warm-up took %.1f s", time.perf_counter() - start)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, and the grammar compile workers (idempotent)."""
        if not self.stopped:
            self.stopped = True
            self.grammar.close()
            stop_ranks(self.executor, self.runner.tp, self.config.world_size, tell=self.ranks_in_step)
            self.runner.close()

    def check_health(self) -> None:
        """EngineDeadError when a tensor-parallel worker is gone (the engine cannot step again)."""
        if why := self.executor.failed():
            raise EngineDeadError(f"a tensor-parallel worker failed: {why}")

    # -- KV sizing ----------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        cfg = self.config
        per_block = self.runner.kv_bytes_per_block()
        if cfg.num_kv_blocks:
            blocks, field = cfg.num_kv_blocks, "num_kv_blocks"
        elif cfg.kv_cache_memory_gb:
            blocks, field = int(cfg.kv_cache_memory_gb * 2**30 // per_block), "kv_cache_memory_gb"
        else:
            budget = cfg.kv_cache_memory_fraction * self.platform.available_memory()
            if self.runner.device.type == "cpu":
                budget /= cfg.world_size  # every rank's cache in this one memory
            blocks, field = int(budget // per_block), "kv_cache_memory_fraction"
        if blocks * cfg.block_size < self.max_model_len:
            raise ValueError(
                f"{field}: the KV cache holds {blocks * cfg.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}; give it more memory or lower max_model_len"
            )
        logger.info("KV cache: %d blocks x %d tokens = %.3f GiB (%s)", blocks, cfg.block_size,
                    blocks * per_block / 2**30, str(self.runner.attn_spec.kv_cache_dtype).removeprefix("torch."))
        return blocks

    def _num_swap_blocks(self) -> int:
        cfg = self.config
        if cfg.preemption_mode != "swap":
            return 0
        if cfg.num_swap_blocks is not None:
            return cfg.num_swap_blocks
        return int(cfg.swap_space_gb * 2**30 // self.runner.kv_bytes_per_block())

    # -- requests -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(token_ids)
        self.validate_params(params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar.submit(params.structured_outputs.spec())
            if grammar.done() and grammar.exception() is not None:
                raise grammar.exception()
        max_tokens = self.max_model_len - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        metrics = RequestMetrics(arrival_time=time.perf_counter() if arrival_time is None else arrival_time)
        seqs = []
        for i in range(params.n):
            seq = Sequence(next(self._seq_ids), request_id, list(token_ids), len(token_ids), params,
                           metrics.arrival_time, index=i, priority=priority)
            if params.seed is not None:
                seq.generator = torch.Generator(self.runner.device).manual_seed(params.seed + i)
            seq.detok = self.tokenizer.stream(params.skip_special_tokens)
            seqs.append(seq)
        req = Request(request_id, text, token_ids, params, seqs, metrics, max_tokens,
                      None if params.prompt_logprobs is None else [None])
        if grammar is None or grammar.done():
            self._start(req, grammar)  # first: a grammar backend that fails here leaves nothing behind
        else:  # NOTE: kept out of the scheduler until compiled; others decode meanwhile
            self.compiling[request_id] = grammar
        self.requests[request_id] = req
        self.counters["prompt_tokens"] += len(token_ids)

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens, longer than max_model_len={self.max_model_len} "
                "allows (it must leave room for at least one generated token)"
            )
        vocab = self.runner.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")

    def validate_params(self, params: SamplingParams) -> None:
        """What a request's settings must satisfy on this engine (its vocabulary and limits),
        beyond SamplingParams' own checks; each ValueError starts with the field's name."""
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n must be at most max_num_seqs={self.config.max_num_seqs} (the sequences this "
                             f"engine runs at once), got {params.n}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.config.max_logprobs:
                raise ValueError(f"{name} must be at most max_logprobs={self.config.max_logprobs}, got "
                                 f"{getattr(params, name)}")
        vocab = self.runner.vocab_size
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids holds {bad}, outside the vocabulary [0, {vocab})")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.compiling.pop(request_id, None)
        for seq in req.seqs:
            if not seq.is_finished:
                self._remove(seq)
                seq.finish_reason = "abort"
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step ---------------------------------------------------------------------
    def _start(self, req: Request, grammar: Future | None) -> None:
        if grammar is not None:
            compiled: CompiledGrammar = grammar.result()
            for seq in req.seqs:
                seq.grammar = compiled.matcher()
        # The other samples fork from the first once its prompt is computed: one prefill, shared blocks.
        req.seqs[0].pending_forks = req.seqs[1:]
        if self.isolation.active:
            self.isolation.held.append(req.seqs[0])
        else:
            self.scheduler.add(req.seqs[0])

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule requests whose grammar is ready; end those whose spec was refused."""
        refused = []
        for rid, grammar in list(self.compiling.items()):
            if not grammar.done():
                continue
            del self.compiling[rid]
            req, error = self.requests[rid], grammar.exception()
            if error is None:
                try:
                    self._start(req, grammar)
                    continue
                except PluginError as e:
                    error = e
            if isinstance(error, PluginError):  # the backend broke, not the spec: fail it with that
                refused.extend(self._fail_request(rid, error))
                continue
            # Callers that validate first (LLM.generate, the server) never get here.
            logger.warning("request %s aborted: %s", rid, error)
            for seq in req.seqs:
                seq.finish_reason, seq.status = "abort", SequenceStatus.FINISHED
            del self.requests[rid]
            refused.append(self._output(req))
        return refused

    def step(self) -> list[RequestOutput]:
        if not self.compiling:
            return self._guarded_step()
        outputs = self._admit_compiled()
        if not outputs and not self.scheduler.has_work() and not self.isolation.active:
            wait_any(self.compiling.values(), timeout=0.05)  # only compiles left: wait, don't spin
            outputs = self._admit_compiled()
        return outputs + self._guarded_step()

    # -- a failed step fails only the requests it belongs to ------------------------------
    def _guarded_step(self) -> list[RequestOutput]:
        """``_step``, and when it raises, find the request(s) at fault instead of failing all.

        NOTE: every sequence drops its KV and keeps its tokens (a recompute preemption),
        then each request that was in the scheduler runs alone until it has sampled again:
        one that raises alone is failed with the error, the others go on together. Greedy
        outputs are those of an undisturbed run, as after any recompute preemption.
        """
        iso = self.isolation
        if iso.active and iso.probe is None:
            self._next_probe()
        try:
            outputs = self._step()
        except Exception as e:  # a PluginError too: a plugin may fail on one request's input only
            if why := self._worker_failure():  # not a request's fault: the engine cannot go on
                raise EngineDeadError(f"a tensor-parallel worker failed: {why}") from e
            if isinstance(e, RanksOutOfStep):
                self.ranks_in_step = False  # shutdown must not send them anything: they are in a collective
                raise EngineDeadError(str(e)) from e
            return self._step_failed(e)
        if not iso.active:
            iso.cleared_all = False
        if iso.probe is not None and self._probe_done(iso.probe):
            # Cleared: out again (its KV too), so the next suspect also runs alone.
            iso.probe = None
            iso.held.extend(self._evict_all())
            if not iso.suspects:
                self._end_isolation()
        return outputs

    def _worker_failure(self) -> str | None:
        """``executor.failed()`` after a step raised. NOTE: a killed worker's sockets close (and
        fail rank 0's collective) just before its exit can be reaped; under tensor parallelism
        the executor gets WORKER_EXIT_GRACE to see it, lest the step's requests be blamed."""
        deadline = time.monotonic() + (WORKER_EXIT_GRACE if self.config.world_size > 1 else 0.0)
        while (why := self.executor.failed()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return why

    def _step_failed(self, error: Exception) -> list[RequestOutput]:
        iso = self.isolation
        if iso.probe is not None:  # it failed alone: it is the culprit
            logger.error("request %s failed alone in a step; failing it: %s", iso.probe, error, exc_info=error)
            rid, iso.probe, iso.found_culprit = iso.probe, None, True
            outputs = self._fail_request(rid, error)
            if not iso.suspects:
                self._end_isolation()
            return outputs
        suspects = [rid for rid in dict.fromkeys(s.request_id for s in self.scheduler.running
                                                 + list(self.scheduler.swapped) + list(self.scheduler.waiting))]
        if iso.cleared_all:
            # Every suspect ran alone without fault and then failed together again: the fault is
            # in the combination, not in one request; fail the ones in flight rather than loop.
            logger.error("step failed again after isolation found no culprit; failing %d requests",
                         len(suspects), exc_info=error)
            outputs = [o for rid in suspects for o in self._fail_request(rid, error)]
            return outputs
        logger.warning("engine step failed (%s: %s); running its %d requests one at a time to find the "
                       "culprit", type(error).__name__, error, len(suspects))
        iso.start(suspects, self._evict_all())
        return []

    def _evict_all(self) -> list[Sequence]:
        seqs = self.scheduler.evict_all()
        for seq in seqs:
            self.spec.forget(seq)
        return seqs

    def _next_probe(self) -> None:
        """Put the next suspect's sequences alone into the scheduler."""
        iso = self.isolation
        while iso.suspects:
            rid = iso.suspects.popleft()
            mine = [s for s in iso.held if s.request_id == rid]
            if rid in self.requests and mine:
                iso.held = [s for s in iso.held if s.request_id != rid]
                for seq in mine:
                    self.scheduler.add(seq)
                iso.probe, iso.probe_tokens = rid, {s: s.num_tokens for s in mine}
                return
        self._end_isolation()

    def _probe_done(self, rid: str) -> bool:
        """True once the probed request ran a full step past its old progress, or ended.
        NOTE: two tokens past it: its recompute's prefill makes one, a decode the other (a
        fault of decode steps only, a proposer's, shows only there)."""
        req = self.requests.get(rid)
        if req is None:
            return True
        live = [s for s in req.seqs if not s.is_finished]
        start = self.isolation.probe_tokens
        return all(s.status is SequenceStatus.RUNNING and s.num_computed_tokens == s.num_tokens - 1
                   and not s.pending_forks and s.num_tokens >= start.get(s, 0) + 2 for s in live)

    def _end_isolation(self) -> None:
        iso = self.isolation
        for seq in iso.held:
            if seq.request_id in self.requests:
                self.scheduler.add(seq)
        iso.finish()

    def _fail_request(self, request_id: str, error: Exception) -> list[RequestOutput]:
        """End one request with ``error``: its blocks are freed, its output says why."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        self.compiling.pop(request_id, None)
        self.isolation.held = [s for s in self.isolation.held if s.request_id != request_id]
        for seq in req.seqs:
            if not seq.is_finished:
                self._remove(seq)
                seq.finish_reason = "error"
        out = self._output(req)
        plugin = isinstance(error, PluginError)  # its message names the plugin and what it broke
        out.error = str(error) if plugin else f"{type(error).__name__}: {error}"
        out.error_kind = "plugin" if plugin else "engine"
        return [out]

    def _step(self) -> list[RequestOutput]:
        """Schedule (running decodes with draft slots), propose drafts, run the model, let
        the scheduler apply the result, emit the new tokens."""
        if not self.scheduler.has_work():
            return []
        self.spec.reserve(self.scheduler.running, self._max_tokens)
        scheduled = self.scheduler.step()
        self.spec.propose(scheduled)
        failed = self._load_kv(scheduled) if scheduled.kv_loads else []
        if not scheduled.seqs:
            return failed
        output = self.runner.execute(scheduled)
        self.scheduler.update(scheduled, output)
        self.spec.count(scheduled, output)
        self.counters["computed_tokens"] += scheduled.num_tokens
        self.counters["steps"] += 1
        return failed + self._emit(output)

    def _load_kv(self, scheduled: ScheduledStep) -> list[RequestOutput]:
        """Load the blocks the KV connector holds for newly admitted sequences. One whose
        load fails leaves the step: it computes its prompt later (``recompute``) or its
        request ends with the error (``fail``)."""
        transfers = [(seq, t) for seq, ts in scheduled.kv_loads.items() for t in ts]
        failed = self.runner.load_kv([t for _, t in transfers])
        if not failed:
            return []
        seqs = list(dict.fromkeys(transfers[i][0] for i in failed))
        recompute = self.config.kv_load_failure_policy == "recompute"
        logger.warning("kv connector: %d of %d blocks failed to load (%s ...); %s %d sequence(s)", len(failed),
                       len(transfers), transfers[failed[0]][1].key[:16],
                       "recomputing" if recompute else "failing", len(seqs))
        self.scheduler.drop_failed_loads(scheduled, seqs, requeue=recompute)
        if recompute:
            return []
        error = KVLoadError(f"the KV connector could not load {len(failed)} block(s) of this prompt "
                            "(kv_load_failure_policy: fail)")
        return [o for rid in dict.fromkeys(s.request_id for s in seqs) for o in self._fail_request(rid, error)]

    def _max_tokens(self, seq: Sequence) -> int:
        return self.requests[seq.request_id].max_tokens

    def _emit(self, output: ModelOutput) -> list[RequestOutput]:
        """Append each sequence's new tokens in order, checking every one for a stop (the
        tokens after it are dropped); free what finished; an output per request touched."""
        now = time.perf_counter()
        for seq, (first, row, num_rows) in output.prompt_seqs.items():
            entries = self.requests[seq.request_id].prompt_logprobs
            # NOTE: a recompute (preemption; a fork that waited for a slot) scores the prompt
            # again from position 0: the entries it already has are skipped, none is lost.
            for i in range(len(entries) - first, num_rows):
                entries.append(_logprob_entry(output.prompt_samples, row + i, seq.params.prompt_logprobs))
        touched: dict[str, Request] = {}
        row = 0  # this sequence's first row in output.samples
        for seq, tokens in output.token_ids.items():
            req = touched[seq.request_id] = self.requests[seq.request_id]
            if req.max_tokens == 0:  # prompt logprobs only: the prefill's sample is dropped
                seq.finish_reason = "length"
            for i, token in enumerate(tokens):
                if seq.finish_reason is not None:
                    break  # a stop string, EOS or max_tokens drops the tokens after it
                self._append_token(req, seq, token, now, output.samples, row + i)
                self.counters["generation_tokens"] += 1
            row += len(tokens)
            if seq.finish_reason is not None:
                self._remove(seq)
        outputs = []
        for req in touched.values():
            if req.finished:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
            outputs.append(self._output(req))
        return outputs

    def _remove(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self.spec.forget(seq)

    def _append_token(self, req: Request, seq: Sequence, token: int, now: float,
                      out: SamplerOutput | None, row: int) -> None:
        params = seq.params
        seq.token_ids.append(token)
        if seq.index == 0:
            req.metrics.token_times.append(now)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
        if params.logprobs is not None:
            seq.logprobs.append(_logprob_entry(out, row, params.logprobs))
        if seq.grammar is not None and not _accepts(seq.grammar, token):
            # The mask allows only what the grammar accepts, so this is a backend bug.
            logger.error("request %s: the grammar rejected sampled token %d; aborting it", req.request_id, token)
            seq.finish_reason = "abort"
            return
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        else:
            delta = seq.detok.step(token)
            if delta:
                seq.text += delta
                if params.stop:
                    _check_stop_strings(seq, len(delta))
        if seq.finish_reason is None and seq.grammar is not None and seq.grammar.is_terminated():
            seq.finish_reason = "stop"  # it accepted an EOS: even with ignore_eos, nothing may follow
        if seq.finish_reason is None and (
            seq.num_output_tokens >= req.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            seq.finish_reason = "length"

    def _output(self, req: Request) -> RequestOutput:
        completions = []
        for seq in req.seqs:
            text = seq.text
            if seq.finish_reason is None and seq.params.stop:
                # Hold back what could still turn out to be the start of a stop string.
                hold = max(len(s) for s in seq.params.stop) - 1
                text = text[: max(0, len(text) - hold)]
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            ))
        # NOTE: not copied: the entries are complete before the first output with a token.
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             req.finished, req.metrics, max(0, req.seqs[0].num_cached_tokens),
                             prompt_logprobs=req.prompt_logprobs)

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        free = self.allocator.num_free_blocks()
        total = self.allocator.num_blocks
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": total,
            "kv_blocks_free": free,
            "kv_usage": 1.0 - free / total,
            "num_swapped": len(self.scheduler.swapped),
            "num_preemptions": self.scheduler.num_preemptions,
            "preemptions_recompute": self.scheduler.preemptions["recompute"],
            "preemptions_swap": self.scheduler.preemptions["swap"],
            "blocks_swapped_out": self.scheduler.blocks_swapped["out"],
            "blocks_swapped_in": self.scheduler.blocks_swapped["in"],
            **({f"kv_connector_blocks_{k}": v for k, v in self.scheduler.kv_blocks.items()}
               | {f"kv_connector_{k}": v for k, v in self.runner.connector.stats().items()}
               if self.runner.connector is not None else {}),
            **self.counters,
            **self.spec.counters,
            **{f"allocator_{k}": v for k, v in self.allocator.stats().items()},
            "weight_bytes": self.runner.weight_bytes,  # as allocated, quantized or not
            "kv_cache_bytes": sum(c.numel() * c.element_size() for c in self.runner.kv_caches),
            **({"expert_tokens": load} if (load := self.runner.expert_load()) else {}),
        }


class KVLoadError(RuntimeError):
    """A KV connector could not load a request's blocks, and the policy is to fail it."""


class EngineDeadError(RuntimeError):
    """The engine cannot run another step (a tensor-parallel worker is gone)."""


@dataclass(slots=True)
class StepIsolation:
    """The engine's state while it looks for the request that made a step fail."""

    suspects: deque[str] = field(default_factory=deque)  # request ids still to run alone
    held: list[Sequence] = field(default_factory=list)  # kept out of the scheduler meanwhile
    probe: str | None = None  # the request running alone now
    probe_tokens: dict[Sequence, int] = field(default_factory=dict)  # its sequences' lengths when it began
    active: bool = False
    found_culprit: bool = False
    # The last isolation found no culprit and no step has succeeded since: the fault is in
    # the combination of requests, and isolating again would only loop.
    cleared_all: bool = False

    def start(self, suspects: list[str], held: list[Sequence]) -> None:
        self.suspects, self.held, self.probe = deque(suspects), held, None
        self.active, self.found_culprit = True, False

    def finish(self) -> None:
        self.cleared_all = not self.found_culprit
        self.held, self.probe, self.active = [], None, False


def _accepts(matcher: GrammarMatcher, token: int) -> bool:
    with calling(matcher, "grammar_backend", "matcher.accept_token()"):
        return matcher.accept_token(token)


def check_plugin_choices(config: EngineConfig, registry: Registry) -> None:
    """Every plugin the config selects exists and accepts its options: ValueError naming the
    kind and the option otherwise, before anything heavy (weights, KV cache) is made."""
    grammar = config.grammar_backend  # auto is the core's, not a plugin (GrammarCompiler checks it)
    chosen = {"platform": config.platform_choice(), "attention_backend": config.attention_backend,
              "kv_allocator": config.kv_allocator, "scheduler": config.scheduler, "sampler": config.sampler,
              "quantizer": config.quantization, "grammar_backend": None if grammar.name == AUTO else grammar,
              "proposer": config.speculative.proposer if config.speculative else None}
    for kind, choice in chosen.items():
        if choice is not None:
            registry.get(kind, choice.name).validate_options(choice.options)


def _check_stop_strings(seq: Sequence, delta_len: int) -> None:
    stops = seq.params.stop
    longest = max(len(s) for s in stops)
    start = max(0, len(seq.text) - delta_len - longest + 1)
    hits = [(i, s) for s in stops if (i := seq.text.find(s, start)) != -1]
    if not hits:
        return
    i, s = min(hits)
    seq.text = seq.text[: i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
    seq.finish_reason, seq.stop_reason = "stop", s


def _logprob_entry(out: SamplerOutput, row: int, num_top: int) -> dict[str, Any]:
    entry = {
        "token_id": int(out.token_ids[row]),
        "logprob": float(out.logprobs[row]),
        "rank": int(out.ranks[row]),
        "top": {},
    }
    if num_top and out.top_ids is not None:
        ids = out.top_ids[row, :num_top].tolist()
        lps = out.top_logprobs[row, :num_top].tolist()
        entry["top"] = dict(zip(ids, lps))
    return entry


