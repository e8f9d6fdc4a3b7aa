"""POST /v1/completions: prompts in, text completions out, whole or streamed."""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from modserve.core.outputs import RequestOutput
from modserve.engine.client import OutputStream
from modserve.engine.preprocess import truncate_prompt
from modserve.server.async_engine import EngineError
from modserve.server.beam_search import beam_params, beam_search
from modserve.server.kv_transfer import kv_transfer
from modserve.server.logprobs import TokenText, completion_logprobs, echo_logprobs, prompt_logprobs
from modserve.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                      PromptLogprobs, Usage)
from modserve.server.serving import (SSE_DONE, Piece, ServerState, StreamTally, arrival_time,
                                     engine_error_event, final_outputs, new_id, refuse_lora_beams, sse,
                                     usage_counts)


async def create_completion(body: CompletionRequest, state: ServerState, request: Request) -> Response:
    arrival = arrival_time()
    lora = await state.resolve_model(body.model)
    body.check()
    texts = body.prompts()
    state.limits.check(body, len(texts))
    defaults = state.generation_defaults
    params = body.sampling_params(defaults.max_tokens(body.max_tokens), body.logprobs, body.engine_prompt_logprobs,
                                  defaults.values)
    await state.tokenize_bad_words(params)
    state.check_params(params)
    state.check_batch(len(texts))  # before any of it is tokenized
    prompts = [await state.encode(p, "prompt") if isinstance(p, str) else list(p) for p in texts]
    prompts = [truncate_prompt(ids, params, state.max_model_len) for ids in prompts]  # truncate_prompt_tokens
    for ids in prompts:
        state.check_prompt(ids, "prompt")
        state.check_context(params, len(ids), "prompt", ("max_tokens", body.max_tokens))
    if not body.stream:
        state.response_bound.check_completion(body.n, list(map(len, prompts)), params.max_tokens, state.max_model_len,
                                              body.echo, body.logprobs, body.prompt_logprobs)
    await state.compile_grammar(params, body.constraint_param)
    echoes = [await state.decode(ids) for ids in prompts] if body.echo else None
    response_id = new_id("cmpl")
    kv = await kv_transfer(body, state, params, response_id)
    if body.use_beam_search:  # no stream, no echo, no logprobs (the request's check refused them)
        refuse_lora_beams(lora)
        search = beam_params(body, params, list(map(len, prompts)), state)
        outputs = await beam_search(state, prompts, search, arrival, body.priority, request)
        return await state.json_response(lambda token_text: _response(body, state, outputs, response_id, None,
                                                                      token_text))
    stream = state.submit(prompts, params, arrival, body.priority, lora)
    if body.stream:
        events = _stream(body, state, stream, response_id, echoes, sum(map(len, prompts)))
        return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(stream.close))
    outputs = await final_outputs(stream, request)
    return await state.json_response(lambda token_text: _response(body, state, outputs, response_id, echoes,
                                                                  token_text, kv))


def _response(body: CompletionRequest, state: ServerState, outputs: list[RequestOutput], response_id: str,
              echoes: list[str] | None, token_text: TokenText, kv: dict | None = None) -> CompletionResponse:
    choices = []
    for i, out in enumerate(outputs):
        prefix = echoes[i] if echoes else ""
        # Built once per prompt, shared by its n choices (as vLLM, each choice repeats it).
        echoed, scored = _prompt_part(body, token_text, out)
        for c in out.outputs:
            logprobs = echoed
            if c.logprobs is not None:  # appended to a copy of the prompt's lists: the others share them
                start = echoed.model_copy(update={k: list(v) for k, v in echoed}) if echoed else None
                logprobs = completion_logprobs(c.logprobs, token_text, len(prefix), start)
            choices.append(CompletionChoice(index=i * body.n + c.index, text=prefix + c.text, logprobs=logprobs,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                            prompt_logprobs=scored))
    return CompletionResponse(id=response_id, model=state.answer_model(body.model), choices=choices,
                              usage=Usage.of(*usage_counts(outputs)), kv_transfer_params=kv)


def _prompt_part(body: CompletionRequest, token_text: TokenText,
                 out: RequestOutput) -> tuple[CompletionLogprobs | None, PromptLogprobs | None]:
    """The prompt's logprobs as asked: echo's part of ``logprobs``, vLLM's ``prompt_logprobs``."""
    entries = out.prompt_logprobs
    echoed = scored = None
    if body.echo and body.logprobs is not None and entries is not None:
        echoed = echo_logprobs(out.prompt_token_ids, entries, token_text, body.logprobs)
    if body.prompt_logprobs is not None and entries is not None:
        scored = prompt_logprobs(entries, token_text, body.prompt_logprobs)
    return echoed, scored


async def _stream(body: CompletionRequest, state: ServerState, stream: OutputStream, response_id: str,
                  echoes: list[str] | None, prompt_tokens: int) -> AsyncIterator[str]:
    tally = StreamTally(body.n, prompt_tokens, body.continuous_usage)
    offsets: dict[int, int] = {}  # choice index -> characters sent, for logprobs' text_offset
    echoed: set[int] = set()  # prompts whose echo was sent
    try:
        async for out in stream:
            i = stream.index(out.request_id)
            if echoes and i not in echoed:  # with its first output: its prompt logprobs are in it
                echoed.add(i)
                logprobs = _prompt_part(body, state.token_text, out)[0]
                for j in range(body.n):
                    offsets[i * body.n + j] = len(echoes[i])
                    yield _chunk(response_id, state, i * body.n + j, Piece(echoes[i], None, None, None), logprobs,
                                 tally.chunk_usage(), body.model)
            for index, piece in tally.pieces(stream, out):
                logprobs = None
                if piece.logprobs is not None:
                    logprobs = completion_logprobs(piece.logprobs, state.token_text, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(piece.text)
                yield _chunk(response_id, state, index, piece, logprobs, tally.chunk_usage(), body.model)
        if body.include_usage:
            yield sse(CompletionResponse(id=response_id, model=state.answer_model(body.model), choices=[],
                                         usage=tally.usage()))
    except EngineError as e:
        yield engine_error_event(e)
    finally:
        stream.close()  # a client that went away aborts here (or in the response's background task)
    yield SSE_DONE


def _chunk(response_id: str, state: ServerState, index: int, piece: Piece, logprobs,
           usage: Usage | None = None, model: str | None = None) -> str:
    choice = CompletionChoice(index=index, text=piece.text, logprobs=logprobs,
                              finish_reason=piece.finish_reason, stop_reason=piece.stop_reason)
    return sse(CompletionResponse(id=response_id, model=state.answer_model(model), choices=[choice], usage=usage))
