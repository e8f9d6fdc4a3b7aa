"""Tool parser: a stream, split anywhere, joins to what ``extract`` gives for the whole text; the
implementation's ``examples`` hold calls whose arguments are JSON objects.

The texts are the implementation's ``examples`` and outputs in every built-in format (a parser
that does not know a format must still agree with itself on it), fed whole, one to three
characters at a time, and at random splits.
"""

from __future__ import annotations

import json
import random

import pytest

from modserve.api import ToolParser
from modserve.testing.conformance.targets import Implementation

CONFORMANCE_KIND = "tool_parser"

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
# Every built-in format, plain prose, and text that only looks like the start of a call.
OTHER_TEXTS = (
    "Plain prose, no tools: the weather is fine.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}',
    'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]',
    '[get_weather(city="Paris"), f(x=[1, 2])]',
    "a < b and [c] { d } <tool_ but not a call",
)


def _texts(implementation: Implementation) -> list[str]:
    return [*implementation.load().examples, *OTHER_TEXTS]


def _splits(text: str) -> dict[str, list[str]]:
    rng = random.Random(len(text))
    cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
    out = {"whole": [text], "random": [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]}
    for size in (1, 2, 3):
        out[f"{size} characters"] = [text[i:i + size] for i in range(0, len(text), size)]
    return out


def _stream(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls, deltas = "", {}, [parser.feed(p) for p in pieces] + [parser.finish()]
    for d in deltas:
        content += d.content
        for c in d.calls:
            if c.index not in calls:
                assert c.name, f"a call's first delta must carry its name: index {c.index} came without one"
                assert c.index == len(calls), f"calls must arrive in order: index {c.index} after {len(calls)}"
                calls[c.index] = [c.name, ""]
            else:
                assert c.name is None, f"the name comes on a call's first delta only (index {c.index})"
            calls[c.index][1] += c.arguments
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


def test_a_stream_joins_to_what_extract_gives(implementation: Implementation) -> None:
    """Contract: feed() pieces and finish() joined equal extract() of the whole text."""
    cls = implementation.load()
    for text in _texts(implementation):
        whole = implementation.create(TOOLS).extract(text)
        expected = (whole.content, [(c.name, c.arguments) for c in whole.calls])
        for how, pieces in _splits(text).items():
            got = _stream(implementation.create(TOOLS), pieces)
            content = got[0] if got[0] and got[0].strip() else None
            assert (content, got[1]) == expected, (
                f"{cls.__name__} streamed {text!r} ({how}) as content {got[0]!r}, calls {got[1]}, but extract "
                f"gives content {expected[0]!r}, calls {expected[1]}: a stream must join to extract's result")


def test_examples_give_calls_with_json_arguments(implementation: Implementation) -> None:
    """Contract: the examples are outputs with calls; each call's arguments are a JSON object's text."""
    cls = implementation.load()
    if not cls.examples:
        pytest.skip(f"{cls.__name__} gives no examples (ToolParser.examples): the kit cannot check its format")
    for text in cls.examples:
        calls = implementation.create(TOOLS).extract(text).calls
        assert calls, f"{cls.__name__}.extract found no call in its own example {text!r}"
        for call in calls:
            try:
                value = json.loads(call.arguments)
            except ValueError:
                value = None
            assert isinstance(value, dict), (
                f"{cls.__name__}: the arguments of {call.name!r} in {text!r} must be a JSON object's text, "
                f"got {call.arguments!r}")
