"""LLMEngine: requests in, one scheduled forward pass per step, outputs out.

One step: the scheduler picks the sequences (with draft slots for speculation), the proposer
drafts, the runner computes on every rank, the scheduler applies the result (the one writer of
the sequences), the output processor turns the new tokens into what the user sees. A step that
raises goes to culprit isolation (:mod:`modserve.engine.isolation`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import Future
from itertools import count
from typing import Any

import torch

from modserve.core.config import EngineConfig
from modserve.core.lora_request import LoRARequest
from modserve.core.contracts.platform import Platform
from modserve.core.contracts.scheduler import SchedulerLimits
from modserve.core.outputs import RequestOutput
from modserve.core.registry import PluginError, Registry, get_registry
from modserve.core.sampling_params import SamplingParams
from modserve.core.sequence import Sequence
from modserve.core.step import ModelOutput, ScheduledStep
from modserve.engine.async_step import OverlappedSteps
from modserve.engine.pipeline_step import PipelinedSteps
from modserve.engine.grammar import AUTO, GrammarCompiler, wait_any
from modserve.engine.grammar_gate import gated
from modserve.engine.grammar_compile import CompiledGrammar
from modserve.engine.isolation import CulpritIsolation
from modserve.engine.kv_events import KVEventStream
from modserve.engine.limits import EngineLimits
from modserve.engine.output import InProcessOutputs, OutputProcessor, Request, TokenReader, new_request, stamp_scheduled
from modserve.engine.preprocess import preprocess_request
from modserve.engine.scheduler import SchedulerCore, SwapSpace
from modserve.engine.spec_decode import SpecDecode
from modserve.engine.tokenizer import Tokenizer
from modserve.runner.build import build_runner, prepare_rank
from modserve.runner.kv_cache_size import kv_cache_blocks, swap_blocks
from modserve.runner.parallel import RanksOutOfStep
from modserve.runner.pooling import PoolingRunner, resolve_pooler
from modserve.runner.ranks import start_ranks, stop_ranks

logger = logging.getLogger("modserve")
WORKER_EXIT_GRACE = 0.5  # seconds, see LLMEngine._worker_failure
NOT_POOLING = "the model is not served as an embedding model: start it with --runner pooling (runner: pooling)"


class LLMEngine:
    def __init__(self, config: EngineConfig, registry: Registry | None = None, progress: bool = True,
                 dp_rank: int = 0, detokenize: bool = True) -> None:
        self.config, self.dp_rank, self.detokenize = config, dp_rank, detokenize  # False: outputs are CoreOutputs
        registry = registry or get_registry()
        check_plugin_choices(config, registry)  # a typo fails now, not after the weights loaded
        setup = prepare_rank(config, registry)  # the platform, seed, checkpoint config: before any rank starts
        self.platform: Platform = setup.platform
        self.dtype, self.max_model_len = setup.dtype, setup.max_model_len
        self.tokenizer = Tokenizer(config.tokenizer or config.model, config.model)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.grammar = GrammarCompiler(registry, config.grammar_backend, config.tokenizer or config.model,
                                       setup.hf_config.vocab_size, self.eos_token_ids, config.grammar_cache_size,
                                       config.grammar_compile_workers, config.grammar_compile_timeout,
                                       config.grammar_compile_isolation, config.grammar_compile_memory_mb)
        self.compiling: dict[str, Future] = {}  # request id -> its grammar, still compiling
        self.ranks_in_step = True  # the other ranks wait for rank 0's next call (not inside one)
        self.stopped = False
        self.executor, tp, pp = start_ranks(config, registry, self.platform)
        try:
            self.runner = build_runner(setup, tp, pp, self.eos_token_ids, progress)
            self.pooler = PoolingRunner(self.runner, resolve_pooler(config, setup.hf_config)) \
                if config.runner == "pooling" else None
            self.limits = EngineLimits(self.runner.vocab_size, self.max_model_len, config.max_num_seqs,
                                       config.max_logprobs, self.runner.logits_processors.classes)
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
        self.num_blocks = kv_cache_blocks(config, self.runner)
        num_host_blocks = swap_blocks(config, self.runner)
        self.runner.allocate_kv_cache(self.num_blocks, num_host_blocks)
        allocator = registry.create("kv_allocator", config.kv_allocator, self.num_blocks, config.block_size,
                                    self.max_model_len)
        limits = SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        policy = registry.create("scheduler", config.scheduler, limits)
        self.scheduler = SchedulerCore(policy, allocator, limits, config.scheduler.name, config.preemption_mode,
                                       SwapSpace(num_host_blocks) if num_host_blocks else None,
                                       self.runner.connector, config.kv_role, self.eos_token_ids,
                                       config.max_loras if config.enable_lora else 0)
        self.allocator = allocator
        self.kv_events = KVEventStream.create(config.kv_events_config, allocator, config.kv_allocator.name,
                                              self.dp_rank, self.platform.device.type)
        self.requests: dict[str, Request] = {}
        self._seq_ids = count()
        self.counters = {"prompt_tokens": 0, "computed_tokens": 0, "generation_tokens": 0, "steps": 0}
        self.spec = SpecDecode.create(config, registry, self.runner, self.num_blocks, self.max_model_len)
        self.isolation = CulpritIsolation(self.scheduler, self.spec.forget)
        self.outputs = InProcessOutputs(OutputProcessor(self.tokenizer)) if self.detokenize else TokenReader()
        self.overlap: OverlappedSteps | PipelinedSteps | None = \
            OverlappedSteps(self) if config.async_scheduling else None
        if config.pipeline_parallel_size > 1 and config.pipeline_in_flight:
            # NOTE: it overlaps a step's output processing with the later stages' work, what
            # async scheduling does with a thread: with both on, this runs
            self.overlap = PipelinedSteps(self, config.pipeline_parallel_size)
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
            self.kv_events.close()
            if self.overlap is not None:
                self.overlap.close()
            stop_ranks(self.executor, self.runner.tp, self.config.world_size, tell=self.ranks_in_step)
            self.runner.close()

    def check_health(self) -> None:
        """EngineDeadError when a tensor-parallel worker is gone (the engine cannot step again)."""
        if why := self.executor.failed():
            raise EngineDeadError(f"a tensor-parallel worker failed: {why}")

    # -- requests -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.runner.check_lora(lora_request)  # a ValueError now, not in a step, if it cannot be used
        token_ids = preprocess_request(self.tokenizer, prompt, params, self.max_model_len)
        self.limits.validate_prompt(token_ids)
        self.limits.validate_params(params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar.submit(params.structured_outputs.spec())
            if grammar.done() and grammar.exception() is not None:
                raise grammar.exception()
        req = self._new_request(request_id, prompt if isinstance(prompt, str) else None, token_ids, params,
                                time.perf_counter() if arrival_time is None else arrival_time, priority, lora_request)
        if grammar is None or grammar.done():
            self._start(req, grammar)  # first: a grammar backend that fails here leaves nothing behind
        else:  # NOTE: kept out of the scheduler until compiled; others decode meanwhile
            self.compiling[request_id] = grammar
        self.requests[request_id] = req
        self.counters["prompt_tokens"] += len(token_ids)

    def _new_request(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams,
                     arrival_time: float, priority: int, lora_request: LoRARequest | None = None) -> Request:
        seqs = []
        for i in range(params.n):
            seq = Sequence(next(self._seq_ids), request_id, list(token_ids), len(token_ids), params,
                           arrival_time, index=i, priority=priority, lora_request=lora_request)
            if params.seed is not None:
                seq.generator = torch.Generator(self.runner.device).manual_seed(params.seed + i)
            seqs.append(seq)
        req = new_request(request_id, token_ids, params, seqs)
        self.outputs.add(req, text, arrival_time)  # its user side: here, or in the API server
        return req

    def add_lora(self, request: LoRARequest) -> None:
        """Check and cache an adapter (vLLM's name); a ValueError says why it cannot run here."""
        self.runner.check_lora(request)

    def kv_transfer_params(self) -> dict[str, Any] | None:
        """A producer's ``kv_transfer_params`` for its prefill responses: its KV connector's."""
        return None if self.runner.connector is None else self.runner.connector.transfer_params()

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter's weights (requests that name it again reload it); whether it was held."""
        return self.runner.lora is not None and self.runner.lora.remove(lora_int_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self._end_request(request_id, "abort")

    def _end_request(self, request_id: str, reason: str) -> RequestOutput | None:
        """End a request's unfinished sequences with ``reason``; None when it is not here."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.compiling.pop(request_id, None)
        self.isolation.drop(request_id)
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, reason)
                self.spec.forget(seq)
        return self.outputs.output(req)

    def embed(self, prompts: list[list[int]], normalize: bool | None = None,
              dimensions: int | None = None) -> list[torch.Tensor]:
        """Pooling runner: each prompt's vector (float32, CPU). NOTE: runs the model outside
        step(), so only between steps (LLM.embed, the server's call_utility)."""
        if self.pooler is None:
            raise ValueError(NOT_POOLING)
        for ids in prompts:
            self.limits.validate_prompt(ids)
        return self.pooler.embed(prompts, normalize, dimensions)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or pipeline steps in flight (an aborted request's blocks come back
        once its step is collected: the caller steps on until then)."""
        return bool(self.requests) or isinstance(self.overlap, PipelinedSteps) and self.overlap.pending

    # -- one step ---------------------------------------------------------------------
    def _start(self, req: Request, grammar: Future | None) -> None:
        if grammar is not None:
            compiled: CompiledGrammar = grammar.result()
            for seq in req.seqs:  # gated: a constraint that starts after the reasoning (grammar_gate.py)
                seq.grammar = gated(compiled.matcher(), req.params.structured_outputs.start_after)
        # The other samples fork from the first once its prompt is computed: one prefill, shared blocks.
        req.seqs[0].pending_forks = req.seqs[1:]
        self.isolation.admit(req.seqs[0])

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
            refused.append(self._end_request(rid, "abort"))
        return refused

    def step(self) -> list[RequestOutput]:
        if not self.compiling:
            return self._guarded_step()
        outputs = self._admit_compiled()
        if not outputs and not self.scheduler.has_work() and not self.isolation.active \
                and not getattr(self.overlap, "pending", None):  # nor a step's tokens left to show
            wait_any(self.compiling.values(), timeout=0.05)  # only compiles left: wait, don't spin
            outputs = self._admit_compiled()
        return outputs + self._guarded_step()

    def _guarded_step(self) -> list[RequestOutput]:
        """``_step``; when it raises, fail the request(s) at fault, not all (culprit isolation)."""
        self.isolation.before_step(self.requests)
        try:
            outputs = self._step()
        except Exception as e:  # a PluginError too: a plugin may fail on one request's input only
            if why := self._worker_failure():  # not a request's fault: the engine cannot go on
                raise EngineDeadError(f"a tensor-parallel worker failed: {why}") from e
            if isinstance(e, RanksOutOfStep):
                self.ranks_in_step = False  # shutdown must not send them anything: they are in a collective
                raise EngineDeadError(str(e)) from e
            shown = self.overlap.take_salvaged() if self.overlap is not None else []  # the step before's
            return shown + [o for rid in self.isolation.failed(e, self.requests) for o in self._fail_request(rid, e)]
        finally:
            self.kv_events.publish()  # the step's blocks stored and evicted, as one batch
        self.isolation.after_step(self.requests)
        return outputs

    def _worker_failure(self) -> str | None:
        """``executor.failed()`` after a step raised. NOTE: a killed worker's sockets close (and
        fail rank 0's collective) just before its exit can be reaped; under tensor parallelism
        the executor gets WORKER_EXIT_GRACE to see it, lest the step's requests be blamed."""
        deadline = time.monotonic() + (WORKER_EXIT_GRACE if self.config.world_size > 1 else 0.0)
        while (why := self.executor.failed()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return why

    def _fail_request(self, request_id: str, error: Exception) -> list[RequestOutput]:
        """End one request with ``error``: its blocks are freed, its output says why."""
        out = self._end_request(request_id, "error")
        if out is None:
            return []
        named = isinstance(error, (PluginError, KVLoadError))  # its message names the plugin and what failed
        out.error = str(error) if named else f"{type(error).__name__}: {error}"
        out.error_kind = "kv_load" if isinstance(error, KVLoadError) else "plugin" if named else "engine"
        return [out]

    def _step(self) -> list[RequestOutput]:
        """Schedule (running decodes with draft slots), propose drafts, run the model, let
        the scheduler apply the result, emit the new tokens."""
        if self.overlap is not None:  # async scheduling: this forward runs while the last step is shown
            return self.overlap.step()
        if not self.scheduler.has_work():
            return []
        scheduled = self.scheduler.step(self.spec.reserve(self.scheduler.running, self._max_tokens))
        self.spec.propose(scheduled)
        failed = self._load_kv(scheduled) if scheduled.kv_loads else []
        if not scheduled.seqs:
            return failed
        stamp_scheduled(self.requests, scheduled.seqs, time.perf_counter())
        output = self.runner.execute(scheduled)
        for seq in self.scheduler.update(scheduled, output):
            self.spec.forget(seq)
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
        lost, of = Counter(transfers[i][0].request_id for i in failed), Counter(s.request_id for s, _ in transfers)
        return [o for rid, n in lost.items() for o in self._fail_request(rid, KVLoadError(
            f"kv_connector {self.config.kv_connector.name}: {n} of {of[rid]} blocks could not be loaded for this "
            "request (kv_load_failure_policy: fail)"))]

    def _max_tokens(self, seq: Sequence) -> int:
        room = self.max_model_len - seq.num_prompt_tokens
        return room if seq.params.max_tokens is None else min(room, seq.params.max_tokens)

    def _emit(self, output: ModelOutput) -> list[RequestOutput]:
        """What the step's new tokens show the users; a stop string found in a text ends its
        sequence there (the scheduler drops the tokens after it)."""
        now = time.perf_counter()
        touched, stops, num_read = self.outputs.process(output, self.requests, now)
        for hit in stops:
            if not hit.seq.is_finished:
                self.spec.forget(hit.seq)
            self.scheduler.finish(hit.seq, "stop", hit.stop, hit.num_output_tokens)
        self.counters["generation_tokens"] += num_read
        for req in touched:
            if req.finished:
                del self.requests[req.request_id]
        return [self.outputs.shown(req, now) for req in touched]

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
               | {f"kv_connector_{k}": v for k, v in self.runner.connector_stats().items()}
               if self.runner.connector is not None else {}),
            **self.counters,
            **self.spec.counters,
            **{f"allocator_{k}": v for k, v in self.allocator.stats().items()},
            "weight_bytes": self.runner.weight_bytes,  # as allocated, quantized or not
            "kv_cache_bytes": sum(c.numel() * c.element_size() for c in self.runner.kv_caches),
            **({"expert_tokens": load} if (load := self.runner.expert_load()) else {}),
            **({"lora": {"max_lora": self.config.max_loras, **self.scheduler.lora_adapters()}}
               if self.config.enable_lora else {}),
        }


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


class KVLoadError(RuntimeError):
    """A KV connector could not load a request's blocks, and the policy is to fail it."""


class EngineDeadError(RuntimeError):
    """The engine cannot run another step (a tensor-parallel worker is gone)."""
