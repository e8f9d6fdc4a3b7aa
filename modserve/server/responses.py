"""OpenAI's Responses API as vLLM serves it: ``POST /v1/responses``, ``GET /v1/responses/{id}``.

A request becomes a chat request (responses_protocol.py) and runs through the chat path
(chat.prepare_chat); its output, read by the same OutputParser as chat's, becomes output
items: ``reasoning`` (with a reasoning parser), ``message`` (``output_text``) and
``function_call``. A stream sends OpenAI's events, each with its ``sequence_number``;
:class:`Items` makes the items for both, so a stream's items are the answer's.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from modserve.core.outputs import RequestOutput
from modserve.engine.client import OutputStream
from modserve.server.async_engine import EngineError
from modserve.server.chat import PreparedChat, prepare_chat
from modserve.server.embeddings import refuse_generate
from modserve.server.errors import APIError
from modserve.server.protocol import ChatCompletionRequest, DeltaMessage, now
from modserve.server.response_store import ResponseStore, StoredResponse
from modserve.server.responses_protocol import ResponsesRequest, renamed
from modserve.server.serving import ServerState, StreamTally, arrival_time, engine_api_error, final_outputs
from modserve.server.tool_calls import OutputParser, reasoning_end

Emit = Callable[..., None]  # emit(event type, **fields)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"  # OpenAI's and vLLM's shape: resp_..., msg_..., fc_..., call_...


def add_response_routes(app: FastAPI, state: ServerState, max_stored: int) -> None:
    store = ResponseStore(max_stored)
    app.state.responses = store

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request) -> Response:
        refuse_generate(app, "/v1/responses")
        return await create_response(body, state, store, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        return JSONResponse(store.get(response_id).response)


async def create_response(body: ResponsesRequest, state: ServerState, store: ResponseStore,
                          request: Request) -> Response:
    arrival = arrival_time()
    await state.resolve_model(body.model)
    body.check()
    history = store.get(body.previous_response_id, "previous_response_id").conversation \
        if body.previous_response_id is not None else []
    messages, conversation = body.messages(history)
    chat = body.chat_request(messages)
    try:
        prepared = await prepare_chat(chat, state)
    except APIError as e:
        raise renamed(e) from None
    end = reasoning_end(state.parsers) if prepared.thinking else None
    marker = await state.encode(end, "input", add_special_tokens=False) if end else []
    stream = state.submit([prepared.prompt], prepared.params, arrival, chat.priority, state.check_model(body.model))
    run = Run(body, chat, state, prepared, store, conversation, marker)
    if body.stream:
        return StreamingResponse(run.events(stream), media_type="text/event-stream",
                                 background=BackgroundTask(stream.close))
    outputs = await final_outputs(stream, request)
    if not outputs:  # the client left before any output: nobody to answer
        return Response(status_code=499)
    items = Items(lambda *a, **k: None)
    parser = run.parser()
    for c in outputs[0].outputs:
        message = parser.message(c.text)
        items.reasoning(message.reasoning_content or "")
        items.text(message.content or "")
        for i, call in enumerate(message.tool_calls or []):
            items.call(i, call.function.name, call.function.arguments)
        items.close("incomplete" if c.finish_reason == "length" else "completed")
    return JSONResponse(run.finish(items, outputs[0]))


class Run:
    """One response: its fixed fields, and what is stored when it ends."""

    def __init__(self, body: ResponsesRequest, chat: ChatCompletionRequest, state: ServerState,
                 prepared: PreparedChat, store: ResponseStore, conversation: list[dict[str, Any]],
                 marker: list[int]) -> None:
        self.body, self.chat, self.state, self.prepared = body, chat, state, prepared
        self.store, self.conversation = store, conversation
        self.marker = marker  # the reasoning's end as token ids: what counts as reasoning_tokens
        self.id = item_id("resp")
        self.created_at = now()

    def parser(self) -> OutputParser:
        return OutputParser(self.prepared.mode, self.state.parsers, self.chat, lambda: item_id("call"),
                            self.prepared.thinking)

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 incomplete: bool = False) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.state.model_name, "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in body.tool_list()],
            "tool_choice": body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none"),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": body.stored,
            "text": {"format": (body.text.format if body.text and body.text.format else {"type": "text"})},
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "truncation": "disabled", "metadata": body.metadata or {}, "user": body.user,
            "background": False,
        }

    def finish(self, items: "Items", out: RequestOutput) -> dict[str, Any]:
        """The final response (stored when asked) from ``items`` and the request's output."""
        c = out.outputs[0]
        usage = {"input_tokens": len(out.prompt_token_ids),
                 "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                 "output_tokens": len(c.token_ids),
                 "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(c.token_ids, items)},
                 "total_tokens": len(out.prompt_token_ids) + len(c.token_ids)}
        incomplete = c.finish_reason == "length"
        response = self.response("incomplete" if incomplete else "completed", items.output, usage, incomplete)
        if self.body.stored:
            self.store.put(self.id, StoredResponse(response, self.conversation + [items.turn()]))
        return response

    def reasoning_tokens(self, token_ids: list[int], items: "Items") -> int:
        """The output's tokens up to the reasoning's end marker (all of them if it never ended)."""
        if not any(i["type"] == "reasoning" for i in items.output):
            return 0
        n = len(self.marker)
        ends = [i + n for i in range(len(token_ids) - n + 1) if n and token_ids[i:i + n] == self.marker]
        return ends[0] if ends else len(token_ids)

    async def events(self, stream: OutputStream) -> AsyncIterator[str]:
        sequence = 0
        pending: list[str] = []

        def emit(kind: str, **fields: Any) -> None:
            nonlocal sequence
            data = json.dumps({"type": kind, "sequence_number": sequence, **fields}, ensure_ascii=False)
            pending.append(f"event: {kind}\ndata: {data}\n\n")
            sequence += 1

        # NOTE: emit writes each event's JSON at once: the item dicts it names change later.
        items, parser, tally = Items(emit), self.parser(), StreamTally(1, len(self.prepared.prompt))
        opening = self.response("in_progress", [])
        emit("response.created", response=opening)
        emit("response.in_progress", response=opening)
        latest = None
        try:
            async for out in stream:
                latest = out
                for _, piece in tally.pieces(stream, out):
                    final = piece.finish_reason is not None
                    delta = parser.delta(piece.text, final=final) or DeltaMessage()
                    items.reasoning(delta.reasoning_content or "")
                    items.text(delta.content or "")
                    for call in delta.tool_calls or []:
                        items.call(call.index, call.function.name, call.function.arguments or "")
                    if final:
                        items.close("incomplete" if piece.finish_reason == "length" else "completed")
                while pending:
                    yield pending.pop(0)
            response = self.finish(items, latest)
            emit("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                 response=response)
        except EngineError as e:
            error = engine_api_error(e)
            emit("error", code=error.code, message=error.message, param=error.param)
        finally:
            stream.close()
        for event in pending:
            yield event


class Items:
    """Output items made from the parsed output's pieces, in the order they come, each
    announced, extended and closed through ``emit`` (OpenAI's stream events)."""

    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> its item

    def reasoning(self, text: str) -> None:
        if text:
            item = self._item("reasoning", {"summary": [], "content": []}, "reasoning_text")
            item["content"][0]["text"] += text
            self.emit("response.reasoning_text.delta", **self._where(item), content_index=0, delta=text)

    def text(self, text: str) -> None:
        if text:
            item = self._item("message", {"role": "assistant", "content": []}, "output_text")
            item["content"][0]["text"] += text
            self.emit("response.output_text.delta", **self._where(item), content_index=0, delta=text, logprobs=[])

    def call(self, index: int, name: str | None, arguments: str) -> None:
        item = self.calls.get(index)
        if item is None:
            self.close("completed")
            item = self.calls[index] = self._open("function_call", {
                "call_id": item_id("call"), "name": name or "", "arguments": ""}, None)
        if arguments:
            item["arguments"] += arguments
            self.emit("response.function_call_arguments.delta", **self._where(item), delta=arguments)

    def close(self, status: str) -> None:
        """End the open item (its done events)."""
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = status
        where = self._where(item)
        if item["type"] == "function_call":
            self.emit("response.function_call_arguments.done", **where, arguments=item["arguments"],
                      name=item["name"])
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            self.emit(f"response.{kind}.done", **where, content_index=0, text=part["text"],
                      **({"logprobs": []} if kind == "output_text" else {}))
            self.emit("response.content_part.done", **where, content_index=0, part=part)
        self.emit("response.output_item.done", output_index=where["output_index"], item=item)

    def turn(self) -> dict[str, Any]:
        """The output as the assistant's chat turn, for the stored conversation."""
        text = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message")
        reasoning = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "reasoning")
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        turn: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            turn["tool_calls"] = calls
        elif not text:
            turn["content"] = ""
        if reasoning:
            turn["reasoning_content"] = reasoning
        return turn

    def _item(self, kind: str, fields: dict[str, Any], part: str) -> dict[str, Any]:
        if self.open is not None and self.open["type"] == kind:
            return self.open
        self.close("completed")
        return self._open(kind, fields, part)

    def _open(self, kind: str, fields: dict[str, Any], part: str | None) -> dict[str, Any]:
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = {"id": item_id(prefix), "type": kind, "status": "in_progress", **fields}
        self.output.append(item)
        self.open = item
        self.emit("response.output_item.added", output_index=len(self.output) - 1, item=item)
        if part is not None:
            empty = {"type": part, "text": ""} | ({"annotations": []} if part == "output_text" else {})
            item["content"].append(empty)
            self.emit("response.content_part.added", **self._where(item), content_index=0, part=dict(empty))
        return item

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item)}


