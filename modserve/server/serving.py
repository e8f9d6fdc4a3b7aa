"""What the completions and chat routes share: admission, prompt checks, SSE, text deltas."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import pydantic_core
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from modserve.core.lora_request import LoRARequest
from modserve.core.outputs import CompletionOutput, RequestOutput
from modserve.core.sampling_params import SamplingParams
from modserve.server.chat_tokenizer import ChatTokenizer, TemplateInputs
from modserve.engine.grammar_compile import START_TIMEOUT_S, CompilerClosed
from modserve.engine.grammar import timeout_message
from modserve.engine.client import EngineClient, OutputStream
from modserve.engine.preprocess import tokenize_bad_words
from modserve.server.async_engine import (DEAD_MESSAGE, EngineDead, EngineError, EngineStopped, PluginFailed,
                                          ShuttingDown, StreamStalled)
from modserve.server.engine_frontend import KVLoadFailed
from modserve.server.errors import APIError, invalid
from modserve.generation_defaults import GenerationDefaults
from modserve.server.grammar_bounds import GrammarBounds, check_bounds
from modserve.server.logprobs import TokenText
from modserve.server.protocol import Usage
from modserve.server.request_limits import RequestLimits
from modserve.server.response_size import ResponseBound
from modserve.server.tokenizer_pool import TokenizerPool
from modserve.server.tool_calls import ParserSettings

SSE_DONE = "data: [DONE]\n\n"
# A large non-streamed answer goes out in pieces of this size (see ServerState.json_response).
BODY_PIECE = 2**20


def sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else _json(payload)
    return f"data: {data}\n\n"


def _json(payload: dict[str, Any]) -> str:
    import json

    return json.dumps(payload, ensure_ascii=False)


def refuse_lora_beams(lora: LoRARequest | None) -> None:
    """Beam search runs on the base model only: a request naming an adapter gets a 400, not the base's beams."""
    if lora is not None:
        raise invalid("use_beam_search", f"is not supported with a LoRA adapter (model {lora.lora_name!r})")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(slots=True)
class ServerState:
    """Everything a route needs; one per app, on ``app.state.server``."""

    engine: EngineClient  # an AsyncEngine, or a ReplicaSet (data-parallel replicas served as one)
    # NOTE: the server's own tokenizer, used on the event-loop thread only and for short
    # work (one token's text); prompts are tokenized, and whole answers built, on the pool's threads.
    tokenizer: ChatTokenizer
    pool: TokenizerPool
    model_name: str
    max_model_len: int
    max_waiting_requests: int
    grammar_timeout: float
    limits: RequestLimits
    max_response_bytes: int
    grammar_bounds: GrammarBounds | None = None  # None: no constraint is measured before it compiles
    allow_special_tokens_in_content: bool = False
    # The model's sampling defaults for fields a request leaves unset (generation_config)
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    model_aliases: tuple[str, ...] = ()  # more names requests may use (served_model_name's others)
    hidden_aliases: tuple[str, ...] = ()  # accepted, never listed: the model's local path (model_names.py)
    loras: dict[str, LoRARequest] = field(default_factory=dict)  # adapter name -> adapter (enable_lora)
    # Loads an adapter a request names but nobody loaded, where lora_resolvers find it (lora_resolve.py)
    resolve_lora: Callable[[str], Awaitable[None]] | None = None
    draining: bool = False  # set on SIGTERM: new requests get 503, those in flight finish
    token_strings: dict[int, str] = field(default_factory=dict)
    # No token is longer than this many characters: a text over max_model_len times it
    # cannot fit, and is refused before it is tokenized.
    max_token_chars: int = 0
    compiles_in_flight: int = 0  # requests waiting for their constraint to compile
    # Told of each submit's request ids and settings (the metrics: vLLM's request_params_max_tokens)
    on_submit: Callable[[list[str], SamplingParams], None] | None = None
    response_bound: ResponseBound = field(init=False)  # a non-streamed response's size, before it runs
    parsers: ParserSettings = field(init=False)  # chat's tool and reasoning parsers (tool_calls.py)

    def __post_init__(self) -> None:
        self.parsers = ParserSettings.of(self.engine.config)  # an unknown parser fails at start
        vocab = self.tokenizer.hf.get_vocab()
        self.max_token_chars = max(len(t) for t in vocab)
        self.response_bound = ResponseBound.of(self.max_response_bytes, vocab)

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter ``name`` selects (None: the base model), or a 404 for a name not served."""
        if name is not None and (lora := self.loras.get(name)) is not None:
            return lora
        if name is not None and name != self.model_name and name not in (*self.model_aliases, *self.hidden_aliases):
            raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")
        return None

    async def resolve_model(self, name: str | None) -> LoRARequest | None:
        """:meth:`check_model`, once the LoRA resolvers have looked for a name not served yet."""
        if name is not None and self.resolve_lora is not None and name not in self.loras \
                and name not in (self.model_name, *self.model_aliases, *self.hidden_aliases):
            await self.resolve_lora(name)
        return self.check_model(name)

    def answer_model(self, name: str | None) -> str:
        """The ``model`` an answer reports: the adapter a request named (as vLLM's), else the served name."""
        return name if name in self.loras else self.model_name

    def check_length(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_model_len * self.max_token_chars:
            raise invalid(param, f"is {num_chars} characters, more than max_model_len={self.max_model_len} "
                          "tokens can hold")

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        self.check_length(len(text), param)
        return await self.pool.run(lambda tok: tok.encode(text, add_special_tokens=add_special_tokens))

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          inputs: TemplateInputs | None = None) -> list[int]:
        self.check_length(sum(len(m["content"] or "") for m in messages), "messages")
        allow = self.allow_special_tokens_in_content
        try:
            return await self.pool.run(lambda tok: tok.encode_chat(messages, add_generation_prompt, allow, inputs))
        except ValueError as e:  # no template, a template that fails, forged special tokens
            raise invalid("messages", str(e)) from None

    async def decode(self, token_ids: list[int]) -> str:
        return await self.pool.run(lambda tok: tok.decode(token_ids, skip_special_tokens=False))

    def check_prompt(self, token_ids: list[int], param: str) -> None:
        try:
            self.engine.limits.validate_prompt(token_ids)
        except ValueError as e:
            raise invalid(param, str(e)) from None

    async def tokenize_bad_words(self, params: SamplingParams) -> None:
        """``params.bad_words`` as token ids (vLLM's rule, engine/preprocess.py), on a tokenizer
        thread; before check_params, which checks them against the vocabulary."""
        if params.bad_words:
            await self.pool.run(lambda tok: tokenize_bad_words(
                params, lambda text: tok.encode(text, add_special_tokens=False)))

    def check_params(self, params: SamplingParams) -> None:
        """The settings against this engine's vocabulary and limits (n, stop_token_ids)."""
        try:
            self.engine.limits.validate_params(params)
        except ValueError as e:  # the messages start with the field's name
            field_name, _, why = str(e).partition(" ")
            if field_name.partition(".")[0] == "extra_args":  # a logits processor's: the request's vllm_xargs
                field_name = "vllm_xargs" + field_name.removeprefix("extra_args")
            raise invalid(field_name, why) from None

    def check_context(self, params: SamplingParams, prompt_len: int, param: str,
                      max_tokens: tuple[str, int | None]) -> None:
        """The output asked for against the context this prompt leaves, for chat and completions
        alike: the request's own ``max_tokens`` (its field name and value) must fit, as vLLM
        refuses; so must ``min_tokens`` (SamplingParams holds it to max_tokens when one is given)."""
        room = self.max_model_len - prompt_len
        name, asked = max_tokens
        if asked is not None and asked > room:
            raise invalid(name, f"is too large: {asked}. This model's maximum context length is {self.max_model_len} "
                          f"tokens and your request has {prompt_len} input tokens ({asked} > {self.max_model_len} "
                          f"- {prompt_len})")
        if params.min_tokens > room:
            raise invalid("min_tokens", f"is {params.min_tokens}, more than the {room} tokens the {param} leaves "
                          f"of max_model_len={self.max_model_len}")

    def check_batch(self, num_prompts: int) -> None:
        """A 400 for more prompts than the queue could ever hold: retrying cannot help."""
        if num_prompts > self.max_waiting_requests:
            raise invalid("prompt", f"holds {num_prompts} prompts, more than max_waiting_requests="
                          f"{self.max_waiting_requests} can ever queue; send them in smaller batches")

    def submit(self, prompts: list[list[int]], params: SamplingParams, arrival: float,
               priority: int = 0, lora_request: LoRARequest | None = None) -> OutputStream:
        """Hand the prompts to the engine, or 503 when too many are already waiting."""
        self.check_batch(len(prompts))
        if self.draining:
            raise APIError(503, "The server is shutting down. Retry on another replica.", type="server_error",
                           code="server_shutting_down")
        if self.engine.num_waiting + len(prompts) > self.max_waiting_requests:
            raise APIError(503, f"The server is overloaded: {self.engine.num_waiting} requests are waiting "
                           f"(max_waiting_requests={self.max_waiting_requests}). Retry shortly.",
                           type="server_error", code="server_overloaded", headers={"Retry-After": "1"})
        try:
            stream = self.engine.submit(prompts, params, arrival, priority, lora_request)
        except EngineDead as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from None
        if self.on_submit is not None:
            self.on_submit(stream.request_ids, params)
        return stream

    async def compile_grammar(self, params: SamplingParams, param: str | None) -> None:
        """Compile the request's constraint before it is queued (off the event loop, on the
        engine's grammar workers): a refused spec, or one slower than the compile timeout,
        is a 400 with the reason; the other requests never wait for it."""
        if params.structured_outputs is None:
            return
        spec = params.structured_outputs.spec()
        if self.grammar_bounds is not None:
            try:  # off the event loop: measuring a schema of 1 MB takes ~0.1 s
                await asyncio.to_thread(check_bounds, spec, self.grammar_bounds)
            except ValueError as e:
                raise invalid(param, str(e)) from None
        self.compiles_in_flight += 1  # the drain on SIGTERM waits for them too
        try:
            grammar = self.engine.compile_grammar(spec)
            # The compiler ends the Future by the timeout itself, killing the compile (its worker's
            # start-up not counted): this bound is a backstop. shield: a client that leaves must
            # not cancel a compile that other requests share.
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(grammar)),
                                   self.grammar_timeout + START_TIMEOUT_S)
        except TimeoutError:
            raise invalid(param, timeout_message(spec, self.grammar_timeout)) from None
        except ValueError as e:
            raise invalid(param, str(e)) from None
        except CompilerClosed:  # the drain's deadline stopped it
            raise APIError(503, "The server is shutting down and this request's constraint did not compile "
                           "within shutdown_timeout. Retry it on another replica.", type="server_error",
                           code="server_shutting_down") from None
        finally:
            self.compiles_in_flight -= 1

    def stop_compiles(self) -> None:
        """Kill the grammar compiles requests wait for (the drain's deadline)."""
        self.engine.stop_compiles()

    def token_text(self, token_id: int) -> str:
        text = self.token_strings.get(token_id)
        if text is None:
            text = self.token_strings[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def token_texts(self, tokenizer: ChatTokenizer) -> TokenText:
        """``token_text`` for another thread: the same cache, what it lacks decoded by ``tokenizer``
        (that thread's own; the server's is the event loop's)."""
        cache = self.token_strings

        def text(token_id: int) -> str:
            found = cache.get(token_id)
            if found is None:
                found = cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
            return found

        return text

    async def json_response(self, build: Callable[[TokenText], BaseModel]) -> Response:
        """The JSON of ``build(token_text)``, built and encoded on a tokenizer-pool thread, sent
        in pieces of BODY_PIECE bytes.

        NOTE: an answer of many MB takes a second or more to build and encode; on the event
        loop that would stall /health and every stream (pydantic's encoder, unlike a long
        json.dumps, lets the loop run meanwhile). Sent whole, it would be copied at once into
        the connection's buffer, on the loop; in pieces, each waits for the client to read."""
        body = await self.pool.run(lambda tok: pydantic_core.to_json(build(self.token_texts(tok))))
        if len(body) <= BODY_PIECE:
            return Response(body, media_type="application/json")

        async def pieces() -> AsyncIterator[memoryview]:
            view = memoryview(body)
            for start in range(0, len(body), BODY_PIECE):
                yield view[start:start + BODY_PIECE]

        return StreamingResponse(pieces(), media_type="application/json", headers={"Content-Length": str(len(body))})


async def final_outputs(stream: OutputStream, request: Request) -> list[RequestOutput]:
    """Run a non-streamed request to the end; a client that hangs up aborts it."""
    latest: dict[str, RequestOutput] = {}
    try:
        async for out in stream:
            latest[out.request_id] = out
            if await request.is_disconnected():
                break
    except EngineError as e:
        raise engine_api_error(e) from None
    finally:
        stream.close()
    return [latest[rid] for rid in stream.request_ids if rid in latest]


def engine_api_error(e: EngineError) -> APIError:
    """What a client sees of a request the engine ended: no text of our own faults (it is
    logged), but a plugin's error as it is: it names the plugin the operator must look at."""
    if isinstance(e, PluginFailed):
        return APIError(500, str(e), type="server_error", code="plugin_error")
    if isinstance(e, KVLoadFailed):  # 503: a router retries it where the blocks are, or computes them
        return APIError(503, f"{e}. Retry it (on another replica) or serve it with kv_load_failure_policy: "
                        "recompute.", type="server_error", code="kv_load_failed")
    if isinstance(e, EngineStopped):
        return APIError(503, f"This request did not finish: {DEAD_MESSAGE}. Retry it on another replica.",
                        type="server_error", code="engine_dead")
    if isinstance(e, StreamStalled):
        return APIError(408, str(e), code="stream_stalled")
    if isinstance(e, ShuttingDown):
        return APIError(503, "The server is shutting down and this request did not finish within "
                        "shutdown_timeout. Retry it on another replica.", type="server_error",
                        code="server_shutting_down")
    return APIError(500, "The engine failed while running this request; the server logged why. The other "
                    "requests were not affected.", type="server_error", code="engine_error")


def engine_error_event(e: EngineError) -> str:
    return sse(engine_api_error(e).body())


@dataclass(slots=True)
class Cursor:
    """How much of one choice a stream has sent so far."""

    text: int = 0
    tokens: int = 0
    started: bool = False
    done: bool = False


@dataclass(slots=True)
class Piece:
    text: str
    logprobs: list[dict[str, Any]] | None
    finish_reason: str | None
    stop_reason: int | str | None


def next_piece(cursor: Cursor, c: CompletionOutput) -> Piece | None:
    """The new text (and its tokens' logprobs) of one choice, or None if nothing to send yet.

    NOTE: the engine's cumulative text only ever grows (it holds back a possible
    stop-string prefix), so deltas joined equal the final text.
    """
    if cursor.done:
        return None
    text = c.text[cursor.text:]
    if not text and not c.finished:
        return None
    logprobs = c.logprobs[cursor.tokens:] if c.logprobs is not None else None
    cursor.text = len(c.text)
    cursor.tokens = len(c.logprobs) if c.logprobs is not None else len(c.token_ids)
    cursor.done = c.finished
    return Piece(text, logprobs, c.finish_reason, c.stop_reason)


@dataclass(slots=True)
class StreamTally:
    """Choice cursors and token counts across the requests of one stream."""

    n: int
    prompt_tokens: int
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats
    cursors: dict[tuple[int, int], Cursor] = field(default_factory=dict)
    completion_tokens: dict[tuple[int, int], int] = field(default_factory=dict)

    def pieces(self, stream: OutputStream, out: RequestOutput) -> Iterator[tuple[int, Piece]]:
        """(choice index, piece) for every choice of ``out`` with something new to send."""
        prompt_index = stream.index(out.request_id)
        for c in out.outputs:
            key = (prompt_index, c.index)
            self.completion_tokens[key] = len(c.token_ids)
            piece = next_piece(self.cursors.setdefault(key, Cursor()), c)
            if piece is not None:
                yield prompt_index * self.n + c.index, piece

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.completion_tokens.values())

    def usage(self) -> Usage:
        """The response's usage so far: every prompt, every choice."""
        return Usage.of(self.prompt_tokens, self.num_completion_tokens)

    def chunk_usage(self) -> Usage | None:
        """What a content chunk carries: the usage so far with continuous_usage_stats, else none."""
        return self.usage() if self.continuous_usage else None


def usage_counts(outputs: list[RequestOutput]) -> tuple[int, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return prompt, completion


def arrival_time() -> float:
    # perf_counter, as the engine's own timings: TTFT then includes the time in the queue.
    return time.perf_counter()
