"""``<think>...</think>`` reasoning (DeepSeek-R1, Qwen3, QwQ): the text inside is the reasoning, the
text after it the content."""

from __future__ import annotations

from typing import Any

from modserve.api import ReasoningDelta, ReasoningParser
from modserve.api.tool_parsing import hold_back

START, END = "<think>", "</think>"


class ThinkParser(ReasoningParser):
    # True: text before </think> is reasoning even without <think> (the template wrote it in the prompt)
    implicit_start = True
    end_marker = END

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._text, self._sent = "", (0, 0)

    def split(self, text: str, final: bool) -> tuple[str, str]:
        body = text.lstrip()
        if body.startswith(START):
            body = body[len(START):]
        elif not final and START.startswith(body):
            return "", ""  # it may still become <think>
        elif not self.implicit_start:
            return "", text
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END):]
        return (body if final else hold_back(body, END)), ""

    def ended_in(self, prompt_text: str) -> bool:
        return prompt_text.rstrip().endswith(END)  # Qwen3's enable_thinking=False writes <think></think>

    def extract(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = self.split(text, final=True)
        return reasoning or None, content or None

    def feed(self, delta: str) -> ReasoningDelta:
        self._text += delta
        return self._diff(final=False)

    def finish(self) -> ReasoningDelta:
        return self._diff(final=True)

    def _diff(self, final: bool) -> ReasoningDelta:
        reasoning, content = self.split(self._text, final)
        out = ReasoningDelta(reasoning[self._sent[0]:], content[self._sent[1]:])
        self._sent = (max(len(reasoning), self._sent[0]), max(len(content), self._sent[1]))
        return out


class DeepSeekR1ReasoningParser(ThinkParser):
    examples = ("<think>\nFirst, 2 + 2.\n</think>\n\nIt is 4.", "Thinking without the opening tag.</think>Done.")
    implicit_start = True


class Qwen3ReasoningParser(ThinkParser):
    examples = ("<think>\nFirst, 2 + 2.\n</think>\n\nIt is 4.", "<think>Cut off mid-thought")
    implicit_start = False  # no <think> at the start: the model did not think, all is content
