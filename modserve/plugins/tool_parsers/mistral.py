"""Mistral calls: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``; the text
before the marker is content."""

from __future__ import annotations

import random
import string

from modserve.api.tool_parsing import PartialCall, ReparsingToolParser, hold_back, json_objects

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ReparsingToolParser):
    examples = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": "]"}}, {"name": "g", "arguments": {}}]')

    def call_id(self) -> str:
        # Mistral's ids are 9 letters and digits (mistral_common checks it, Mistral's own chat
        # template refuses any other), as vLLM's mistral parser makes them.
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        s = text.find(MARKER)
        if s < 0:
            return (text if final else hold_back(text, MARKER)), []
        rest = text[s + len(MARKER):]
        body = rest.lstrip()
        if not body:
            return text[:s], []
        if not body.startswith("["):
            return text[:s] + rest, []
        after, calls = json_objects(body[1:], ",", "]", final)
        return text[:s] + after, calls
