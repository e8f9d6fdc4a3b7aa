"""The offline API: ``LLM(model=...).generate(prompts, params)``, as in vLLM."""

from __future__ import annotations

import json
import weakref
from functools import lru_cache
from itertools import count
from pathlib import Path
from typing import Any, Sequence as Seq

import torch
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from modserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, check_beam_search, step_entry
from modserve.core.config import EngineConfig
from modserve.core.lora_request import LoRARequest
from modserve.config_files import load_config_file
from modserve.engine.engine import LLMEngine
from modserve.engine.limits import EngineLimits
from modserve.engine.preprocess import preprocess_request, tokenize_bad_words
from modserve.generation_defaults import GenerationDefaults
from modserve.core.outputs import RequestOutput
from modserve.core.registry import Registry
from modserve.core.sampling_params import SamplingParams
from modserve.inputs import PromptType, parse_prompts
from modserve.outputs import (Decode, EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput,
                              add_vllm_logprobs)
from modserve.pooling_params import PoolingParams
from modserve.server.grammar_bounds import GrammarBounds, check_bounds
from modserve.vllm_compat import engine_config

Messages = list[dict[str, Any]]


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """As vLLM: an assistant turn's tool-call arguments (JSON text in OpenAI's format) reach the
    template as a mapping, which templates such as Qwen's write with ``tojson``."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function", {}))
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


class LLM:
    """An engine for offline batches. ``LLM(model=path, **overrides)`` takes any
    :class:`EngineConfig` field as a keyword, and vLLM's engine arguments as ``modserve serve``
    takes them (``gpu_memory_utilization``, ``enforce_eager``, ``dtype="half"``, ...: see
    :mod:`modserve.vllm_compat`); ``LLM.from_config(file, **overrides)``.

    With ``tensor_parallel_size > 1`` the engine has worker processes: ``shutdown()`` (or a
    ``with LLM(...) as llm:`` block) stops them; an LLM dropped, or still alive when the
    interpreter exits, stops them then."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 registry: Registry | None = None, progress: bool = True, **overrides: Any) -> None:
        data = config.model_dump() if config is not None else {}
        if model:
            data["model"] = model
        config = engine_config(data, **overrides)
        self.config = config
        if config.data_parallel_size > 1:
            raise ValueError("data_parallel_size: replicas are the server's (modserve serve --data-parallel-size); "
                             "an LLM runs one engine")
        self.generation_defaults = GenerationDefaults.of(config)  # a bad file fails before the model loads
        self.engine = LLMEngine(config, registry=registry, progress=progress)
        # NOTE: holds the engine, never self: run when this LLM is collected or at exit.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        if config.chat_template:  # for chat(), as the server's tokenizers take it
            self.engine.tokenizer.hf.chat_template = config.chat_template_text()
        self._ids = count()

    @classmethod
    def from_config(cls, path: str | Path, **overrides: Any) -> "LLM":
        registry = overrides.pop("registry", None)
        progress = overrides.pop("progress", True)
        config = engine_config(load_config_file(path), **overrides)
        return cls(config=config, registry=registry, progress=progress)

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers (idempotent); this LLM generates no more."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _check_running(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was shut down")

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The Hugging Face tokenizer, as vLLM's ``LLM.get_tokenizer()`` (with the configured
        chat_template)."""
        return self.engine.tokenizer.hf

    def get_default_sampling_params(self) -> SamplingParams:
        """As vLLM's: the model's sampling defaults (``generation_config``, with
        ``override_generation_config``), what ``generate`` and ``chat`` use when given no
        ``sampling_params``; a SamplingParams passed explicitly keeps its own fields."""
        return self.generation_defaults.sampling_params()

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes, as vLLM's ``LLM.reset_prefix_cache``: a benchmark that
        repeats a workload measures its prompts, not cache hits."""
        self.engine.allocator.reset_prefix_cache()
        self.engine.kv_events.publish()  # AllBlocksCleared now, not with the next step's events

    # -- what a benchmark reports of the engine: read here, so that callers never reach into it
    @property
    def limits(self) -> EngineLimits:
        """What a request must satisfy on this engine (max_model_len, vocabulary, n, logprobs)."""
        return self.engine.limits

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in."""
        return self.engine.dtype

    def describe_device(self) -> str:
        """The hardware and the kernel routes it takes, in the platform's words."""
        return self.engine.platform.describe()

    @property
    def prefix_caching(self) -> bool:
        """Whether the KV allocator caches prompt prefixes (an allocator without the option: no)."""
        return bool(getattr(self.engine.allocator, "caching", False))

    @property
    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: quantized or not, a 16-bit decode copy if one is kept."""
        return self.engine.runner.decode_weight_bytes

    def expert_load(self) -> dict[int, list[int]]:
        """Mixture-of-experts models: tokens routed to each expert so far, per layer; empty when dense."""
        return self.engine.runner.expert_load()

    def stage_times(self) -> list[float]:
        """Pipeline parallel: seconds each rank (by global rank) has spent inside its stage's layers."""
        return self.engine.runner.stage_times()

    @property
    def model_module(self) -> torch.nn.Module:
        """The loaded model (rank 0's part of it under tensor or pipeline parallelism)."""
        return self.engine.runner.model

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. A prompt is a
        ``str``, a list of token ids, or vLLM's ``TextPrompt`` / ``TokensPrompt`` dict
        (:mod:`modserve.inputs`). ``priority`` (one per prompt, lower first) matters under the
        priority scheduler. Logprobs come in vLLM's shape (:class:`modserve.outputs.PositionLogprobs`).
        ``lora_request``: one adapter for every prompt or one per prompt (None: the base model); needs
        ``enable_lora``."""
        self._check_running()
        if self.config.runner == "pooling":
            raise ValueError("this LLM runs the pooling runner (runner: pooling): use embed() or encode(), "
                             "not generate()")
        parsed = parse_prompts(prompts)
        prompts = [p.engine_input for p in parsed]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        # Compile every constraint first (on the engine's grammar workers): a refused
        # schema is a ValueError here, before any request is queued.
        compiler = self.engine.grammar
        specs = [p.structured_outputs.spec() for p in params if p.structured_outputs is not None]
        bounds = GrammarBounds.from_config(self.config)
        for spec in specs:
            check_bounds(spec, bounds)  # the same grammar_max_* bounds as the server's
        for spec, grammar in [(spec, compiler.submit(spec)) for spec in specs]:
            compiler.result(grammar, spec)
        params = self._with_bad_words_tokenized(params)
        for p in params:
            self.engine.limits.validate_params(p)
        prompts = [prompt if p.truncate_prompt_tokens is None else  # then tokenized here, to be cut
                   preprocess_request(self.engine.tokenizer, prompt, p, self.engine.max_model_len)
                   for prompt, p in zip(prompts, params)]
        order = {}
        try:
            for prompt, p, prio, lora in zip(prompts, params, priorities, loras):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p, priority=prio, lora_request=lora)
                order[rid] = len(order)
        except Exception:
            for rid in order:  # nothing half-submitted stays behind
                self.engine.abort_request(rid)
            raise
        outputs = self._run(order, use_tqdm)
        token_text = self._token_text()
        for out, p, sp in zip(outputs, parsed, params):
            add_vllm_logprobs(out, token_text if sp.detokenize else None)
            if out.prompt is None:  # a TokensPrompt's own text, if it has one
                out.prompt = p.text
        return outputs

    def encode(self, prompts: PromptType | Seq[PromptType], pooling_params: PoolingParams | None = None,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """The pooling runner (``runner="pooling"``): each prompt's pooled vector as a tensor, in
        input order (vLLM's ``LLM.encode``). A ValueError under the generate runner."""
        self._check_running()
        params = pooling_params or PoolingParams()
        tok = self.engine.tokenizer
        ids = [tok.encode(p.engine_input) if isinstance(p.engine_input, str) else list(p.engine_input)
               for p in parse_prompts(prompts)]
        vectors = self.engine.embed(ids, params.normalize, params.dimensions)
        return [PoolingRequestOutput(f"embd-{next(self._ids)}", PoolingOutput(v), p) for v, p in zip(vectors, ids)]

    def embed(self, prompts: PromptType | Seq[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """As :meth:`encode`, each vector a list of floats at ``.outputs.embedding`` (vLLM's ``LLM.embed``)."""
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data.tolist()), o.prompt_token_ids)
                for o in self.encode(prompts, pooling_params, use_tqdm)]

    def chat(
        self,
        messages: Messages | Seq[Messages],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, str]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the chat template (the request's ``chat_template``, else the config's or the
        tokenizer's) to each conversation, with ``tools``, ``documents`` and ``chat_template_kwargs``
        as transformers' ``apply_chat_template`` takes them, then generate. The output is the
        model's text: tool calls in it are not parsed (as vLLM's ``LLM.chat``)."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message cannot be combined with add_generation_prompt=True")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        texts = [tok.hf.apply_chat_template(
            [_template_message(m) for m in c], tools=tools, documents=documents, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tokenize=False, **(chat_template_kwargs or {})) for c in conversations]
        return self.generate([tok.encode(t, add_special_tokens=False) for t in texts], sampling_params, use_tqdm)

    def beam_search(self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams,
                    lora_request: Any = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search`` (:mod:`modserve.beam_search`): each prompt's best
        ``beam_width`` sequences, best first; a sequence's ``tokens`` and ``text`` are the
        prompt's then the generated ones (a final EOS too), as vLLM's. ``concurrency_limit``:
        how many prompts are searched at once (default: all)."""
        self._check_running()
        if lora_request is not None:
            raise ValueError("lora_request: beam_search runs the base model only (generate takes adapters)")
        tok = self.engine.tokenizer
        ids = [tok.encode(p.engine_input) if isinstance(p.engine_input, str) else list(p.engine_input)
               for p in parse_prompts(prompts)]
        for prompt in ids:
            self.engine.limits.validate_prompt(prompt)
            check_beam_search(params, len(prompt), self.engine.max_model_len, self.engine.limits.max_logprobs)
        searches = [BeamSearch(prompt, params, tok.hf.eos_token_id) for prompt in ids]
        limit = concurrency_limit or len(searches) or 1
        step = params.step_params()
        for start in tqdm(range(0, len(searches), limit), desc="Beam search", disable=not use_tqdm):
            group = searches[start:start + limit]
            while live := [s for s in group if not s.done]:
                outputs = iter(self.generate([p for s in live for p in s.live_prompts()], step, use_tqdm=False))
                for s in live:  # each search's beams, in the order they went out
                    s.advance([step_entry(next(outputs)) for _ in s.beams])
        results = []
        for s in searches:
            best = s.best()
            for beam in best:
                beam.text = tok.hf.decode(beam.tokens)
            results.append(BeamSearchOutput(best))
        return results

    def _token_text(self) -> Decode:
        """One token id's text alone, as vLLM's ``decoded_token`` (``tokenizer.decode([id])``);
        cached for one call: the top-N lists repeat tokens."""
        hf = self.engine.tokenizer.hf
        return lru_cache(maxsize=None)(lambda token_id: hf.decode([token_id]))

    def _with_bad_words_tokenized(self, params: list[SamplingParams]) -> list[SamplingParams]:
        """``params`` with bad_words tokenized, each one that has them a copy (once per object):
        the caller's SamplingParams stay as they were."""
        tok, copies = self.engine.tokenizer, {}
        for p in params:
            if p.bad_words and p.bad_words_token_ids is None and id(p) not in copies:
                copies[id(p)] = p.clone()
                tokenize_bad_words(copies[id(p)], lambda text: tok.encode(text, add_special_tokens=False))
        return [copies.get(id(p), p) for p in params]

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Generating", unit="req", disable=not use_tqdm)
        out_tokens = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[order[out.request_id]] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix(out_tok_s=f"{out_tokens / max(bar.format_dict['elapsed'], 1e-9):.1f}")
        except BaseException:
            for rid in list(self.engine.requests):
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]
