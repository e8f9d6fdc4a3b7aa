"""POST /v1/chat/completions: messages through the tokenizer's chat template, then generate; tool
calls and reasoning read from the output by tool_calls.py."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from modserve.core.outputs import RequestOutput
from modserve.core.sampling_params import SamplingParams
from modserve.engine.client import OutputStream
from modserve.engine.preprocess import truncate_prompt
from modserve.server.async_engine import EngineError
from modserve.server.beam_search import beam_params, beam_search
from modserve.server.chat_tokenizer import TemplateInputs
from modserve.server.kv_transfer import kv_transfer
from modserve.server.logprobs import TokenText, chat_logprobs, prompt_logprobs
from modserve.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatMessage, DeltaMessage, Usage, now)
from modserve.server.serving import (SSE_DONE, ServerState, StreamTally, arrival_time, engine_error_event,
                                     final_outputs, new_id, refuse_lora_beams, sse, usage_counts)
from modserve.server.tool_calls import OutputParser, check_thinking, reasoning_end, template_inputs, tool_mode


async def chat_prompt(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True,
                      inputs: TemplateInputs | None = None) -> list[int]:
    # The template writes every special token the model expects; the content's own
    # special-token text stays text (unless the server allows it).
    return await state.encode_chat([m.as_template_input() for m in messages], add_generation_prompt, inputs)


PROMPT_TAIL = 32  # tokens of the prompt's end a reasoning parser reads to see if the template closed the reasoning


def _tool_call_id() -> str:
    return new_id("chatcmpl-tool")  # vLLM's


@dataclass(slots=True)
class PreparedChat:
    """A chat request checked and ready to submit (its constraint compiled)."""

    prompt: list[int]
    params: SamplingParams
    mode: str  # tool_mode's
    thinking: bool  # the output opens with reasoning (check_thinking)


async def prepare_chat(body: ChatCompletionRequest, state: ServerState) -> PreparedChat:
    """Every check, the prompt through the template, and the constraint compiled: what chat
    completions and the Responses API (responses.py) share before they submit."""
    await state.resolve_model(body.model)
    body.check()
    mode = tool_mode(body, state.parsers)  # before the sampling params: required and named add a constraint
    state.limits.check(body, 1)
    defaults = state.generation_defaults
    params = body.sampling_params(defaults.max_tokens(body.max_new_tokens), body.num_logprobs, body.prompt_logprobs,
                                  defaults.values)
    await state.tokenize_bad_words(params)
    state.check_params(params)
    prompt = await chat_prompt(state, body.messages, body.generation_prompt, template_inputs(body))
    prompt = truncate_prompt(prompt, params, state.max_model_len)  # truncate_prompt_tokens, as vLLM's chat
    state.check_prompt(prompt, "messages")
    thinking = check_thinking(body, state.parsers, await state.decode(prompt[-PROMPT_TAIL:]))
    asked = ("max_completion_tokens", body.max_completion_tokens) if body.max_completion_tokens is not None \
        else ("max_tokens", body.max_tokens)
    state.check_context(params, len(prompt), "messages", asked)
    if not body.stream:
        state.response_bound.check_chat(body.n, len(prompt), params.max_tokens, state.max_model_len,
                                        body.num_logprobs, body.prompt_logprobs)
    if thinking and params.structured_outputs is not None:  # the constraint starts after the reasoning
        marker = await state.encode(reasoning_end(state.parsers), "messages", add_special_tokens=False)
        params.structured_outputs = replace(params.structured_outputs, start_after=tuple(marker))
    await state.compile_grammar(params, body.constraint_param)
    return PreparedChat(prompt, params, mode, thinking)


async def create_chat_completion(body: ChatCompletionRequest, state: ServerState, request: Request) -> Response:
    arrival = arrival_time()
    chat = await prepare_chat(body, state)
    response_id = new_id("chatcmpl")
    kv = await kv_transfer(body, state, chat.params, response_id)
    if body.use_beam_search:  # not streamed, no logprobs (the request's check refused them)
        refuse_lora_beams(state.check_model(body.model))
        search = beam_params(body, chat.params, [len(chat.prompt)], state)
        outputs = await beam_search(state, [chat.prompt], search, arrival, body.priority, request)
        return await state.json_response(
            lambda token_text: _response(body, state, outputs, response_id, token_text, chat.mode, chat.thinking))
    stream = state.submit([chat.prompt], chat.params, arrival, body.priority, state.check_model(body.model))
    if body.stream:
        events = _stream(body, state, stream, response_id, len(chat.prompt), chat.mode, chat.thinking)
        return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(stream.close))
    outputs = await final_outputs(stream, request)
    return await state.json_response(
        lambda token_text: _response(body, state, outputs, response_id, token_text, chat.mode, chat.thinking, kv))


def _response(body: ChatCompletionRequest, state: ServerState, outputs: list[RequestOutput],
              response_id: str, token_text: TokenText, mode: str, thinking: bool,
              kv: dict | None = None) -> ChatCompletionResponse:
    choices = []
    for out in outputs:
        for c in out.outputs:
            logprobs = chat_logprobs(c.logprobs, token_text) if c.logprobs is not None else None
            parser = OutputParser(mode, state.parsers, body, _tool_call_id, thinking)
            message = parser.message(c.text)
            choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                      finish_reason=parser.finish_reason(c.finish_reason), stop_reason=c.stop_reason))
    scored = None
    if body.prompt_logprobs is not None and outputs and outputs[0].prompt_logprobs is not None:
        scored = prompt_logprobs(outputs[0].prompt_logprobs, token_text, body.prompt_logprobs)
    return ChatCompletionResponse(id=response_id, model=state.answer_model(body.model), choices=choices,
                                  usage=Usage.of(*usage_counts(outputs)), prompt_logprobs=scored,
                                  kv_transfer_params=kv)


async def _stream(body: ChatCompletionRequest, state: ServerState, stream: OutputStream, response_id: str,
                  prompt_tokens: int, mode: str, thinking: bool) -> AsyncIterator[str]:
    created = now()

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=response_id, created=created, model=state.answer_model(body.model),
                                       choices=choices, usage=usage or tally.chunk_usage()))

    tally = StreamTally(body.n, prompt_tokens, body.continuous_usage)
    parsers: dict[int, OutputParser] = {}
    try:
        # As OpenAI: each choice opens with the role and empty content.
        for i in range(body.n):
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        async for out in stream:
            for index, piece in tally.pieces(stream, out):
                logprobs = chat_logprobs(piece.logprobs, state.token_text) if piece.logprobs is not None else None
                if index not in parsers:  # one per choice: a parser keeps the text so far
                    parsers[index] = OutputParser(mode, state.parsers, body, _tool_call_id, thinking)
                parser = parsers[index]
                delta = parser.delta(piece.text, final=piece.finish_reason is not None)
                if delta is None and logprobs is None and piece.finish_reason is None:
                    continue  # held back by a parser: nothing to send yet
                yield chunk([ChatChunkChoice(index=index, delta=delta or DeltaMessage(), logprobs=logprobs,
                                             finish_reason=parser.finish_reason(piece.finish_reason),
                                             stop_reason=piece.stop_reason)])
        if body.include_usage:
            yield chunk([], tally.usage())
    except EngineError as e:
        yield engine_error_event(e)
    finally:
        stream.close()
    yield SSE_DONE
