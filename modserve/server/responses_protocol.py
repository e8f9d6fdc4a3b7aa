"""The Responses API's request (``POST /v1/responses``) and how it becomes a chat request.

A Responses request is served by the chat path (templates, tool parsers, ``required`` and
named tools enforced by structured output): :meth:`ResponsesRequest.chat_request` turns its
``instructions``, the stored conversation of ``previous_response_id`` and its ``input`` items
into chat messages. Items and tools are read by hand, so a refusal names the item
(``input.2.type``) and says what is not supported, not which union member failed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from modserve.core.sampling_params import INT64_MAX
from modserve.server.errors import APIError, invalid
from modserve.server.protocol import ChatCompletionRequest, Strict, TextChecked

# Built-in tools OpenAI runs on its side; this server runs the model only.
SERVER_TOOLS = "web_search, file_search, computer_use, code_interpreter, image_generation, mcp, shell"
# A chat field's name -> the Responses field a client sent it as (errors name the latter).
RENAMED = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


class TextPartIn(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an output message sent back as input carries them
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPartIn]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningText(Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    status: str | None = None


ITEMS: dict[str, type[Strict]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                  "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningOptions(Strict):
    effort: Literal["low", "medium", "high"] | None = None
    summary: None = None  # summaries are a model's second pass: not served
    generate_summary: None = None


class TextOptions(Strict):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    verbosity: None = None


class ResponsesRequest(TextChecked, Strict):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    store: bool | None = None  # None: true, as OpenAI
    previous_response_id: str | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    truncation: Literal["disabled"] | None = None  # "auto" drops old turns: not done here
    background: bool | None = None
    include: list[str] | None = None
    service_tier: Literal["auto", "default"] | None = None

    def check(self) -> None:
        if self.background:
            raise invalid("background", "is not supported: responses run in the request that creates them")
        if self.include:
            raise invalid("include", f"is not supported ({', '.join(self.include)}): there is nothing extra to "
                          "include from this server")

    @property
    def stored(self) -> bool:
        return self.store is not False

    def tool_list(self) -> list[FunctionTool]:
        out = []
        for i, t in enumerate(self.tools or []):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise invalid(f"tools.{i}.type", f"{kind!r} tools are not supported: this server runs function "
                              f"tools only (built-in tools such as {SERVER_TOOLS} run on OpenAI's side)")
            out.append(_parse(FunctionTool, t, f"tools.{i}"))
        return out

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str) \
                and set(choice) == {"type", "name"}:
            return {"type": "function", "function": {"name": choice["name"]}}
        raise invalid("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...}; '
                      "other choices (built-in or allowed_tools) are not supported")

    def response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if fmt.get("type") == "json_schema":
            schema = {k: v for k, v in fmt.items() if k in ("name", "description", "schema", "strict")}
            return {"type": "json_schema", "json_schema": schema}
        raise invalid("text.format", 'type must be "text", "json_object" or "json_schema"')

    def messages(self, history: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(the chat messages to render, the conversation to store): ``instructions`` first,
        not stored (as OpenAI, they do not carry over to a later response), then ``history``
        (the previous response's conversation), then this input's items."""
        conversation = list(history)
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        reasoning = None  # a reasoning item goes with the assistant turn after it
        for i, raw in enumerate(items):
            item = _item(raw, i)
            if isinstance(item, ReasoningItem):
                reasoning = "".join(c.text for c in item.content or [])
            elif isinstance(item, MessageItem):
                conversation.append({"role": item.role, "content": item.text()})
                if item.role == "assistant" and reasoning:
                    conversation[-1]["reasoning_content"], reasoning = reasoning, None
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = conversation[-1] if conversation else None
                if last is not None and last["role"] == "assistant":  # one turn's text and calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    conversation.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning:
                    conversation[-1]["reasoning_content"], reasoning = reasoning, None
            else:
                conversation.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        return system + conversation, conversation

    def chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                 for t in self.tool_list()]
        body = {"model": self.model, "messages": messages, "tools": tools or None,
                "tool_choice": self.chat_tool_choice(), "parallel_tool_calls": self.parallel_tool_calls,
                "max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "stream": bool(self.stream), "user": self.user, "response_format": self.response_format(),
                "reasoning_effort": self.reasoning.effort if self.reasoning is not None else None}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            raise renamed(invalid(".".join(str(p) for p in err["loc"]),
                                  err["msg"].removeprefix("Value error, "))) from None


def renamed(e: APIError) -> APIError:
    """A chat-path error with the Responses field's name (``max_tokens`` -> ``max_output_tokens``)."""
    if e.param is None:
        return e
    head, _, rest = e.param.partition(".")
    if head not in RENAMED:
        return e
    param = RENAMED[head] + ("." + rest if rest else "")
    message = param + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
    return APIError(e.status, message, e.type, param, e.code, e.headers)


def _item(raw: Any, i: int) -> Strict:
    if not isinstance(raw, dict):
        raise invalid(f"input.{i}", "must be an object (a message or an item)")
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind not in ITEMS:
        raise invalid(f"input.{i}.type", f"{kind!r} items are not supported: this server takes message, "
                      "function_call, function_call_output and reasoning items")
    if kind == "message" and isinstance(raw.get("content"), list):
        for j, part in enumerate(raw["content"]):
            ptype = part.get("type") if isinstance(part, dict) else None
            if ptype not in ("input_text", "output_text"):
                raise invalid(f"input.{i}.content.{j}.type", f"{ptype} content is not supported: this server "
                              "serves text-only models (input_text parts only)")
    return _parse(ITEMS[kind], raw, f"input.{i}")


def _parse(model: type[Strict], raw: Any, where: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join([where, *(str(p) for p in err["loc"] if not str(p).startswith(("str", "list[")))])
        message = "unknown or unsupported field" if err["type"] == "extra_forbidden" else err["msg"]
        raise invalid(loc, message.removeprefix("Value error, ")) from None


class ResponseObject(BaseModel):
    """A Responses API answer's shape, for /openapi.json (responses.py builds it as a dict)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ResponseEvent(BaseModel):
    """One streamed event's data: its ``type`` and ``sequence_number``, then the type's fields."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int
