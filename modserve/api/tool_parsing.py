"""Helpers for tool parsers (the built-ins' and the server's for tool_choice required and named):
one ``parse`` of the text so far serves both the whole text and a stream, so a stream cannot
disagree with ``extract``.

``parse(text, final)`` gives the content and the calls found so far. While the text is not
final it holds back what may still become part of a call (a marker's first characters, an
object not yet closed) and gives each call's arguments only as far as they cannot change.
Feeding a stream re-parses the text so far and sends what grew since the last piece.

NOTE: re-parsing costs the text's length per piece; the built-ins find their markers with
``str.find`` and stop at text that cannot be a call, which keeps long answers cheap.
"""

from __future__ import annotations

import json
import re
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

from modserve.core.contracts.tool_parser import ToolCall, ToolCallDelta, ToolExtraction, ToolParser, ToolStreamDelta


@dataclass(slots=True)
class PartialCall:
    name: str | None  # None until the name is complete
    arguments: str  # what is known of the arguments: a prefix of the final text


class ReparsingToolParser(ToolParser):
    """A :class:`ToolParser` from one ``parse(text, final)``: ``extract``, ``feed`` and ``finish``
    follow from it. Content that is only whitespace is no content (None)."""

    def __init__(self, tools: list[dict[str, Any]] | None = None, options: Any = None) -> None:
        super().__init__(tools, options)
        self._text = ""
        self._content_sent = 0
        self._args_sent: list[int] = []  # per call whose name was sent: argument characters sent

    @abstractmethod
    def parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]: ...

    def extract(self, text: str) -> ToolExtraction:
        content, calls = self.parse(text, final=True)
        return ToolExtraction(content if content.strip() else None,
                              [ToolCall(c.name, c.arguments or "{}") for c in calls if c.name is not None])

    def feed(self, delta: str) -> ToolStreamDelta:
        self._text += delta
        return self._diff(*self.parse(self._text, final=False), final=False)

    def finish(self) -> ToolStreamDelta:
        return self._diff(*self.parse(self._text, final=True), final=True)

    def _diff(self, content: str, calls: list[PartialCall], final: bool) -> ToolStreamDelta:
        # NOTE: content that is only whitespace is None in extract(): hold it until it is more.
        out = ToolStreamDelta(content[self._content_sent:] if content.strip() else "")
        if content.strip():
            self._content_sent = len(content)
        for i, call in enumerate(calls):
            if call.name is None:
                break  # later calls wait: the order is the text's
            arguments = call.arguments or ("{}" if final else "")
            if i == len(self._args_sent):
                out.calls.append(ToolCallDelta(i, call.name, arguments))
                self._args_sent.append(len(arguments))
            elif len(arguments) > self._args_sent[i]:
                out.calls.append(ToolCallDelta(i, None, arguments[self._args_sent[i]:]))
                self._args_sent[i] = len(arguments)
        return out


def hold_back(text: str, marker: str) -> str:
    """``text`` without a trailing start of ``marker`` (which the next piece may complete)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


def value_end(text: str, start: int) -> int | None:
    """Where the JSON value at ``text[start]`` ends (exclusive), or None if the text ends first."""
    if start >= len(text):
        return None
    if text[start] not in "{[\"":  # a number or literal: ends at a delimiter
        m = re.compile(r"[^,}\]\s]*").match(text, start)
        return m.end() if m.end() < len(text) else None
    depth, i, in_string = 0, start, False
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*(?:,\s*"(?:arguments|parameters)"\s*:\s*)?')


def json_call(text: str, complete: bool) -> PartialCall | None:
    """The call a ``{"name": ..., "arguments"|"parameters": {...}}`` object's text holds so far;
    ``complete``: the object is closed. None: a closed object that is not a call."""
    m = _NAME_FIRST.match(text)
    if complete:
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        if m is None or not m.group(0).rstrip().endswith(":"):  # another layout: the parsed arguments
            args = obj.get("arguments", obj.get("parameters", {}))
            return PartialCall(obj["name"], json.dumps(args, ensure_ascii=False))
    if m is None:
        return PartialCall(None, "")
    name = json.loads(m.group(1))
    if not m.group(0).rstrip().endswith(":"):
        return PartialCall(name, "")  # the arguments key not (yet) seen
    start = m.end()
    end = value_end(text, start)
    return PartialCall(name, text[start:end] if end is not None else text[start:].rstrip())


def json_objects(body: str, separator: str, close: str | None, final: bool) -> tuple[str, list[PartialCall]]:
    """Calls written as JSON objects one after another, each followed by ``separator``, the run
    ended by ``close`` (None: the text's end); what follows them, or what is not a call, is content."""
    calls: list[PartialCall] = []
    i = 0
    while True:
        i += len(body[i:]) - len(body[i:].lstrip())
        if i >= len(body):
            return "", calls
        if body[i] != "{":
            if close is not None and body.startswith(close, i):
                i += len(close)
            return body[i:], calls
        end = value_end(body, i)
        if end is None:
            call = json_call(body[i:], complete=False)
            if final and call.name is None:
                return body[i:], calls
            return "", [*calls, call]
        call = json_call(body[i:end], complete=True)
        if call is None:
            return body[i:], calls
        calls.append(call)
        i = end + len(body[end:]) - len(body[end:].lstrip())
        if body.startswith(separator, i):
            i += len(separator)
