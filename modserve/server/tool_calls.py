"""Tool calling and reasoning in chat completions, as vLLM serves them.

``tool_choice`` decides how calls come about: ``none`` (the text is content), ``auto`` (the
model decides; the server's tool parser reads calls from free text), ``required`` and a named
function (enforced: the output is constrained by a JSON schema through the structured-output
path, so it is a valid call whatever the weights). :class:`OutputParser` turns one choice's
text into ``reasoning_content``, ``content`` and ``tool_calls``, whole or as stream deltas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from modserve.api.tool_parsing import PartialCall, ReparsingToolParser, json_objects
from modserve.core.config import EngineConfig
from modserve.core.contracts.reasoning_parser import ReasoningDelta, ReasoningParser
from modserve.core.contracts.tool_parser import ToolCallDelta, ToolParser, ToolStreamDelta
from modserve.core.registry import Registration, get_registry
from modserve.core.structured_outputs import StructuredOutputs
from modserve.server.chat_tokenizer import TemplateInputs
from modserve.server.errors import invalid
from modserve.server.protocol import (ChatCompletionRequest, ChatMessageOut, DeltaFunctionCall, DeltaMessage,
                                      DeltaToolCall, FunctionCallOut, ToolCallOut)

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
# apply_chat_template's own parameters: chat_template_kwargs may not set them
RESERVED_KWARGS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                   "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                   "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


@dataclass(slots=True)
class ParserSettings:
    """The server's tool and reasoning parsers (config ``tool_call_parser``, ``reasoning_parser``)."""

    tool: Registration | None = None
    tool_options: dict[str, Any] | None = None
    reasoning: Registration | None = None
    reasoning_options: dict[str, Any] | None = None
    auto: bool = False  # enable_auto_tool_choice

    @classmethod
    def of(cls, config: EngineConfig) -> "ParserSettings":
        """Unknown names and bad options fail here, at start, naming what is installed."""
        registry, out = get_registry(), cls(auto=config.enable_auto_tool_choice)
        for kind, choice, attr in (("tool_parser", config.tool_call_parser, "tool"),
                                   ("reasoning_parser", config.reasoning_parser, "reasoning")):
            if choice is not None:
                reg = registry.get(kind, choice.name)
                reg.validate_options(choice.options)
                setattr(out, attr, reg)
                setattr(out, f"{attr}_options", choice.options)
        if out.auto and out.tool is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser NAME)")
        return out


def template_inputs(body: ChatCompletionRequest) -> TemplateInputs:
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = sorted(RESERVED_KWARGS.intersection(kwargs))
    if reserved:
        raise invalid("chat_template_kwargs", f"may not set {', '.join(reserved)}: they are request fields "
                      "or the server's")
    if body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
    return TemplateInputs(tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                          documents=body.documents, chat_template=body.chat_template,
                          continue_final_message=bool(body.continue_final_message), kwargs=kwargs)


def tool_mode(body: ChatCompletionRequest, settings: ParserSettings) -> str:
    """``none``, ``auto``, ``required`` or ``named``, after checking the request's tool fields;
    for ``required`` and ``named`` the request gets the constraint that enforces them."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice", "needs tools")
        return "none"
    if choice is None or choice == "auto":  # vLLM's default when tools are given
        if not settings.auto:
            raise invalid("tool_choice", AUTO_NEEDS_FLAGS)
        return "auto"
    if choice == "none":
        return "none"
    if body.constraint is not None:
        raise invalid("tool_choice", f"cannot be combined with {body.constraint_param}: a request takes one "
                      "output constraint")
    if body.min_tokens:
        raise invalid("min_tokens", "cannot be combined with tool_choice required or named: the constraint "
                      "decides where the output ends")
    if choice == "required":
        mode, schema = "required", required_schema(body)
    else:
        found = [t for t in body.tools if t.function.name == choice.function.name]
        if not found:
            raise invalid("tool_choice", f"names {choice.function.name!r}, which is not among the tools: "
                          f"{', '.join(t.function.name for t in body.tools)}")
        mode, schema = "named", found[0].function.parameters or {"type": "object"}
    try:
        body.enforce("tool_choice", StructuredOutputs(json=schema))
    except ValueError as e:
        raise invalid("tools", str(e)) from None
    return mode


def check_thinking(body: ChatCompletionRequest, settings: ParserSettings, prompt_tail: str) -> bool:
    """Whether the output starts with reasoning: a reasoning parser is set and the prompt (its
    last characters) has not closed the reasoning already. A constraint then starts after the
    parser's ``end_marker`` (:func:`reasoning_end`); a parser without one refuses it.

    NOTE: without a marker the engine cannot tell where the reasoning ends, and the
    constraint would force the answer's format onto the reasoning."""
    thinking = settings.reasoning is not None and not settings.reasoning.create(
        settings.reasoning_options or {}).ended_in(prompt_tail)
    if thinking and body.constraint is not None and reasoning_end(settings) is None:
        raise invalid(body.constraint_param, f"cannot be combined with the reasoning parser "
                      f"{settings.reasoning.name!r} while the model reasons: it names no end marker, so the "
                      "constraint would apply from the first token (a chat template that closes the reasoning in "
                      "the prompt, as Qwen3's with enable_thinking false, lifts this)")
    return thinking


def reasoning_end(settings: ParserSettings) -> str | None:
    """The text that ends the reasoning, after which a constraint holds (None: no parser, or
    one without a marker)."""
    return settings.reasoning.load().end_marker if settings.reasoning is not None else None


def required_schema(body: ChatCompletionRequest) -> dict[str, Any]:
    """A JSON array of calls, each ``{"name": <one of the tools>, "arguments": <its parameters>}``.

    NOTE: vLLM's key is ``parameters``; ``arguments`` is what hermes-style models write in their
    own calls, so the constrained text reads to them as their format does. Clients never see it."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                "arguments": t.function.parameters or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in body.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


class RequiredCalls(ReparsingToolParser):
    """The output under ``tool_choice: required``: the JSON array of ``required_schema``."""

    def parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        body = text.lstrip()
        return json_objects(body[1:], ",", "]", final) if body.startswith("[") else (text, [])


class NamedCall(ReparsingToolParser):
    """The output under a named tool choice: that function's arguments, nothing else."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        return "", [PartialCall(self.name, text.rstrip())]


class OutputParser:
    """One choice's text as reasoning_content, content and tool calls (a new one per choice)."""

    def __init__(self, mode: str, settings: ParserSettings, body: ChatCompletionRequest,
                 new_id: Callable[[], str], thinking: bool) -> None:
        self.mode, self.new_id = mode, new_id
        self.reasoning: ReasoningParser | None = settings.reasoning.create(settings.reasoning_options or {}) \
            if thinking else None
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        self.tools: ToolParser | None = {
            "auto": lambda: settings.tool.create(settings.tool_options or {}, tools),
            "required": RequiredCalls,
            "named": lambda: NamedCall(body.tool_choice.function.name),
            "none": lambda: None}[mode]()
        self.first_only = body.parallel_tool_calls is False
        self.called = False

    def call_id(self) -> str:
        """The parser's own id form where it has one (Mistral's, as vLLM's parser gives), else the server's."""
        return (self.tools.call_id() if self.tools is not None else None) or self.new_id()

    def message(self, text: str) -> ChatMessageOut:
        reasoning, content = self.reasoning.extract(text) if self.reasoning is not None else (None, text)
        calls = []
        if self.tools is not None:
            content, calls = self.tools.extract(content or "")
            calls = calls[:1] if self.first_only else calls
        self.called = bool(calls)
        return ChatMessageOut(content=content, reasoning_content=reasoning, tool_calls=[
            ToolCallOut(id=self.call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in calls] or None)

    def delta(self, text: str, final: bool) -> DeltaMessage | None:
        """What this piece of the stream adds; ``final``: the output's last piece."""
        r = self.reasoning.feed(text) if self.reasoning is not None else ReasoningDelta("", text)
        if final and self.reasoning is not None:
            end = self.reasoning.finish()
            r = ReasoningDelta(r.reasoning + end.reasoning, r.content + end.content)
        d = ToolStreamDelta(r.content)
        if self.tools is not None:
            d = self.tools.feed(r.content)
            if final:
                d = _merge(d, self.tools.finish())
        calls = [c for c in d.calls if not (self.first_only and c.index > 0)]
        self.called = self.called or bool(calls)
        if not (r.reasoning or d.content or calls):
            return None
        return DeltaMessage(reasoning_content=r.reasoning or None, content=d.content or None, tool_calls=[
            DeltaToolCall(index=c.index, id=self.call_id() if c.name else None, type="function" if c.name else None,
                          function=DeltaFunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """As vLLM: ``tool_calls`` when auto found calls, or required ended normally; a named call
        keeps the engine's reason."""
        if (self.mode == "auto" and self.called) or (self.mode == "required" and engine_reason == "stop"):
            return "tool_calls"
        return engine_reason


def _merge(a: ToolStreamDelta, b: ToolStreamDelta) -> ToolStreamDelta:
    calls: dict[int, ToolCallDelta] = {}
    for c in a.calls + b.calls:
        if c.index in calls:
            calls[c.index] = ToolCallDelta(c.index, calls[c.index].name, calls[c.index].arguments + c.arguments)
        else:
            calls[c.index] = ToolCallDelta(c.index, c.name, c.arguments)
    return ToolStreamDelta(a.content + b.content, list(calls.values()))
