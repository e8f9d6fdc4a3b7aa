"""Reasoning parser: a stream, split anywhere, joins to what ``extract`` gives for the whole text;
the implementation's ``examples`` hold reasoning.
"""

from __future__ import annotations

import pytest

from modserve.api import ReasoningParser
from modserve.testing.conformance.test_tool_parser import _splits
from modserve.testing.conformance.targets import Implementation

CONFORMANCE_KIND = "reasoning_parser"

OTHER_TEXTS = ("<think>\nweigh it up\n</think>\n\nThe answer.", "reasoning only, no opening tag</think>answer",
               "No reasoning at all.", "<think>cut off", "a <thin b </thi c")


def _stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str | None, str | None]:
    reasoning = content = ""
    for d in [parser.feed(p) for p in pieces] + [parser.finish()]:
        reasoning += d.reasoning
        content += d.content
    return reasoning or None, content or None


def test_a_stream_joins_to_what_extract_gives(implementation: Implementation) -> None:
    """Contract: feed() pieces and finish() joined equal extract() of the whole text."""
    cls = implementation.load()
    for text in [*cls.examples, *OTHER_TEXTS]:
        expected = implementation.create().extract(text)
        for how, pieces in _splits(text).items():
            got = _stream(implementation.create(), pieces)
            assert got == expected, (f"{cls.__name__} streamed {text!r} ({how}) as (reasoning, content) {got}, "
                                     f"but extract gives {expected}: a stream must join to extract's result")


def test_examples_give_reasoning(implementation: Implementation) -> None:
    """Contract: the examples are outputs with reasoning."""
    cls = implementation.load()
    if not cls.examples:
        pytest.skip(f"{cls.__name__} gives no examples (ReasoningParser.examples)")
    for text in cls.examples:
        reasoning, _ = implementation.create().extract(text)
        assert reasoning, f"{cls.__name__}.extract found no reasoning in its own example {text!r}"


def test_the_content_is_what_follows_the_end_marker(implementation: Implementation) -> None:
    """Contract: with an ``end_marker``, an example that holds it has as content exactly the text
    after it: the server constrains that text (structured output after reasoning)."""
    cls = implementation.load()
    if cls.end_marker is None:
        pytest.skip(f"{cls.__name__} names no end_marker")
    closed = [t for t in cls.examples if cls.end_marker in t]
    if not closed:
        pytest.skip(f"{cls.__name__} gives no example that closes its reasoning with {cls.end_marker!r}")
    for text in closed:
        _, content = implementation.create().extract(text)
        after = text.partition(cls.end_marker)[2] or None
        assert content == after, (f"{cls.__name__}.extract({text!r}) gives content {content!r}; the text after its "
                                  f"end_marker {cls.end_marker!r} is {after!r}, which a constraint holds")
