"""The tool parser's contract (config key ``tool_call_parser``): a model's text -> OpenAI tool calls."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from pydantic import BaseModel


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI's function.arguments


class ToolExtraction(NamedTuple):
    content: str | None  # the text that is not a call; None when there is none (or only whitespace)
    calls: list[ToolCall]


@dataclass(slots=True)
class ToolCallDelta:
    """One piece of one call in a stream: ``name`` on the call's first piece only, then
    ``arguments`` fragments whose concatenation is the call's arguments."""

    index: int  # the call's position among this output's calls, from 0
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ToolStreamDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser(ABC):
    """Finds the tool calls in one output's text, the way a model family writes them.

    Contract: ``extract(text)`` parses a whole output. For a stream, one instance per output
    is fed the text in pieces (``feed(delta)``, any split, down to one character), then
    ``finish()`` once at the end; what they return, joined, is ``extract`` of the whole text:
    the content deltas concatenated are its content (or empty where it is None), and each
    call's name and argument fragments are its name and arguments, calls in the same order.
    A piece of text that may still turn out to be part of a call is held back, not sent as
    content. Text that does not parse as a call is content. ``tools`` are the request's tool
    definitions (OpenAI's ``{"type": "function", "function": {...}}``) or None. ``examples``:
    outputs written as the model family writes calls, for the conformance kit.
    """

    examples: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[dict[str, Any]] | None = None, options: BaseModel | None = None) -> None:
        self.tools = tools or []
        self.options = options

    @abstractmethod
    def extract(self, text: str) -> ToolExtraction: ...

    @abstractmethod
    def feed(self, delta: str) -> ToolStreamDelta: ...

    @abstractmethod
    def finish(self) -> ToolStreamDelta: ...

    def call_id(self) -> str | None:
        """A new id for a call this parser read, in its family's own form; None: the server's."""
        return None
