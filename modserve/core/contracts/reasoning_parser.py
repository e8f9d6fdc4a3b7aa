"""The reasoning parser's contract (config key ``reasoning_parser``): a model's thinking apart from its answer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser(ABC):
    """Splits one output's text into ``reasoning_content`` and ``content``.

    Contract: ``extract(text)`` returns ``(reasoning, content)``, either None when empty; the
    markers that delimit the reasoning belong to neither. For a stream, one instance per
    output is fed the text in pieces (``feed(delta)``, any split), then ``finish()`` once;
    their reasoning pieces joined are ``extract``'s reasoning and their content pieces its
    content (empty strings where it gives None). A possible marker's beginning is held back
    until it is known to be one or not. ``examples``: outputs that hold reasoning, for the
    conformance kit.
    """

    examples: ClassVar[tuple[str, ...]] = ()
    # The text that ends the reasoning (``</think>``): a request's constraint (response_format,
    # required or named tools) starts after the tokens of it in the output, as vLLM's does.
    # None: this parser has no such marker, and a constraint is refused while the model reasons.
    end_marker: ClassVar[str | None] = None

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options

    def ended_in(self, prompt_text: str) -> bool:
        """Whether the prompt's end already closed the reasoning (a template that turned thinking
        off); then the output is all content, and a constraint may hold from its first token."""
        return False

    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, str | None]: ...

    @abstractmethod
    def feed(self, delta: str) -> ReasoningDelta: ...

    @abstractmethod
    def finish(self) -> ReasoningDelta: ...
