"""vLLM's token-in/token-out API: ``POST /inference/v1/generate`` (token ids and sampling
settings in; token ids, and logprobs when asked, out; whole or streamed) and ``GET /load``.

The shapes are vLLM's (``GenerateRequest``, ``GenerateResponse``, ``GenerateStreamResponse``
in vllm/entrypoints/serve/disagg/protocol.py), for routers and RL trainers that tokenize
themselves. The request is held to the same limits as /v1/completions.
"""

from __future__ import annotations

from contextlib import contextmanager
from itertools import islice
from typing import Any, AsyncIterator, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field, model_validator
from starlette.background import BackgroundTask

from modserve.core.outputs import RequestOutput
from modserve.core.sampling_params import INT64_MAX, SamplingParams
from modserve.engine.client import OutputStream
from modserve.engine.preprocess import truncate_prompt
from modserve.server.async_engine import EngineError
from modserve.server.errors import APIError, invalid
from modserve.server.logprobs import TokenText, prompt_logprobs
from modserve.server.protocol import (ChatLogprobs, ChatTokenLogprob, Int64, NumLogprobs, PromptLogprobs, Strict,
                                      StreamOptions, TextChecked, TokenId, TopLogprob, Usage, now)
from modserve.server.serving import (SSE_DONE, ServerState, arrival_time, engine_error_event, final_outputs, new_id,
                                     sse)


class NullsAreDefaults(BaseModel):
    """A field sent as null takes its default (clients send explicit nulls)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class TokenSamplingParams(NullsAreDefaults, Strict):
    """vLLM's ``SamplingParams`` as /inference/v1/generate takes it: the fields modserve has.
    Unset ones take vLLM's neutral values (not the model's generation_config, as in vLLM);
    ``max_tokens`` unset runs to the server's default (the context's end, or its cap)."""

    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=INT64_MAX)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    logprobs: NumLogprobs | None = None
    prompt_logprobs: NumLogprobs | None = None
    detokenize: bool | None = None  # None: only with stop strings (which are found in the text)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None  # token id (a JSON key: a string) -> bias
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)

    def engine_params(self, max_tokens: int | None) -> SamplingParams:
        try:
            bias = None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise invalid("logit_bias", "keys must be token ids (integers, sent as strings)") from None
        fields = self.model_dump(exclude={"max_tokens", "detokenize", "logit_bias", "stop_token_ids"})
        try:
            return SamplingParams(**fields, max_tokens=max_tokens, logit_bias=bias,
                                  stop_token_ids=self.stop_token_ids or [],
                                  detokenize=bool(self.stop) if self.detokenize is None else self.detokenize)
        except ValueError as e:  # SamplingParams' messages start with the field's name
            raise invalid(str(e).split(" ", 1)[0], str(e).split(" ", 1)[-1]) from None


class GenerateRequest(TextChecked, NullsAreDefaults, Strict):
    request_id: str | None = None  # returned as given (default: a new id)
    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: TokenSamplingParams
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Int64 = 0
    cache_salt: str | None = None  # vLLM's; refused unless null (no salted prefix cache here)
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's disaggregation; refused unless null

    def check(self) -> None:
        for name in ("cache_salt", "kv_transfer_params"):
            if getattr(self, name) is not None:
                raise invalid(name, "is not supported by modserve")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "only allowed when stream is true")
        if self.stream and self.sampling_params.prompt_logprobs is not None:
            raise invalid("sampling_params.prompt_logprobs", "not available when stream is true")


class GenerateChoice(BaseModel):
    index: int
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = "stop"
    token_ids: list[int] | None = None


class GenerateResponse(BaseModel):
    request_id: str
    model: str | None = None
    created: int | None = None
    choices: list[GenerateChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: dict[str, Any] | None = None


class GenerateStreamChoice(BaseModel):
    index: int
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class GenerateStreamResponse(BaseModel):
    request_id: str
    choices: list[GenerateStreamChoice]
    usage: Usage | None = None


class LoadResponse(BaseModel):
    """vLLM's ``/load`` (``server_load``), with the scheduler's state under vLLM's metric names."""

    server_load: int  # requests in flight (accepted, not ended)
    num_requests_waiting: int
    num_requests_running: int
    kv_cache_usage_perc: float


def add_generate_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/inference/v1/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        return await create_generate(body, state, request)

    @app.get("/load")
    async def load() -> LoadResponse:
        stats = await state.engine.stats()
        return LoadResponse(server_load=state.engine.num_in_flight, num_requests_waiting=stats.get("num_waiting", 0),
                            num_requests_running=stats.get("num_running", 0),
                            kv_cache_usage_perc=stats.get("kv_usage", 0.0))


@contextmanager
def _under(prefix: str) -> Iterator[None]:
    """A 400 about one of the sampling settings names it under ``sampling_params``."""
    try:
        yield
    except APIError as e:
        if e.status != 400 or not e.param:
            raise
        raise invalid(f"{prefix}.{e.param}", e.message.removeprefix(f"{e.param}: ")) from None


async def create_generate(body: GenerateRequest, state: ServerState, request: Request) -> Response:
    arrival = arrival_time()
    lora = await state.resolve_model(body.model)
    body.check()
    sp = body.sampling_params
    with _under("sampling_params"):
        state.limits.check(sp, 1)
        params = sp.engine_params(state.generation_defaults.max_tokens(sp.max_tokens))
        await state.tokenize_bad_words(params)
        state.check_params(params)
    ids = truncate_prompt(list(body.token_ids), params, state.max_model_len)
    state.check_prompt(ids, "token_ids")
    state.check_context(params, len(ids), "token_ids", ("sampling_params.max_tokens", sp.max_tokens))
    if not body.stream:  # estimated as completions' answer: each token as long as the longest token's text
        with _under("sampling_params"):
            state.response_bound.check_completion(sp.n, [len(ids)], params.max_tokens, state.max_model_len, False,
                                                  sp.logprobs, sp.prompt_logprobs)
    stream = state.submit([ids], params, arrival, body.priority, lora)
    request_id = body.request_id or new_id("gen")
    if body.stream:
        events = _stream(body, state, stream, request_id, len(ids))
        return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(stream.close))
    outputs = await final_outputs(stream, request)
    return await state.json_response(lambda token_text: _response(body, state, outputs, request_id, token_text))


def token_logprobs(entries: list[dict[str, Any]], num_top: int) -> ChatLogprobs:
    """vLLM's tokens-only logprobs: chat's shape, each token named ``token_id:<id>``."""
    content = []
    for e in entries:
        top = [TopLogprob(token=f"token_id:{t}", logprob=max(lp, -9999.0))
               for t, lp in islice(e["top"].items(), num_top)]
        content.append(ChatTokenLogprob(token=f"token_id:{e['token_id']}", logprob=max(e["logprob"], -9999.0),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)


def _response(body: GenerateRequest, state: ServerState, outputs: list[RequestOutput], request_id: str,
              token_text: TokenText) -> GenerateResponse:
    sp = body.sampling_params
    choices, prompt_len, generated, scored = [], 0, 0, None
    for out in outputs:  # one: one prompt
        prompt_len = len(out.prompt_token_ids)
        for c in out.outputs:
            logprobs = token_logprobs(c.logprobs, sp.logprobs) if c.logprobs is not None else None
            choices.append(GenerateChoice(index=c.index, logprobs=logprobs, finish_reason=c.finish_reason or "stop",
                                          token_ids=list(c.token_ids)))
            generated += len(c.token_ids)
        if sp.prompt_logprobs is not None and out.prompt_logprobs is not None:
            scored = prompt_logprobs(out.prompt_logprobs, token_text, sp.prompt_logprobs)
    return GenerateResponse(request_id=request_id, model=state.model_name, created=now(), choices=choices,
                            usage=Usage.of(prompt_len, generated), prompt_logprobs=scored)


async def _stream(body: GenerateRequest, state: ServerState, stream: OutputStream, request_id: str,
                  prompt_len: int) -> AsyncIterator[str]:
    sp = body.sampling_params
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    continuous = include_usage and body.stream_options.continuous_usage_stats
    sent: dict[int, int] = {}  # choice -> its tokens sent
    done: set[int] = set()
    try:
        async for out in stream:
            for c in out.outputs:
                start = sent.get(c.index, 0)
                if c.index in done or (len(c.token_ids) == start and not c.finished):
                    continue
                sent[c.index] = len(c.token_ids)
                if c.finished:
                    done.add(c.index)
                logprobs = None if c.logprobs is None else token_logprobs(c.logprobs[start:len(c.token_ids)],
                                                                          sp.logprobs)
                choice = GenerateStreamChoice(index=c.index, logprobs=logprobs, finish_reason=c.finish_reason,
                                              token_ids=list(c.token_ids[start:]))
                usage = Usage.of(prompt_len, sent[c.index]) if continuous else None
                yield sse(GenerateStreamResponse(request_id=request_id, choices=[choice], usage=usage))
        if include_usage:
            final = GenerateStreamResponse(request_id=request_id, choices=[], usage=Usage.of(prompt_len,
                                                                                             sum(sent.values())))
            yield f"data: {final.model_dump_json(exclude_none=True)}\n\n"
    except EngineError as e:
        yield engine_error_event(e)
    finally:
        stream.close()  # a client that went away aborts here (or in the response's background task)
    yield SSE_DONE
