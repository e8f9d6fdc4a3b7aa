"""Llama 3.1/3.2 JSON calls: ``{"name": ..., "parameters": {...}}`` objects separated by ``;``, at the
start of the output, optionally after ``<|python_tag|>``; an output that starts otherwise is content."""

from __future__ import annotations

from modserve.api.tool_parsing import PartialCall, ReparsingToolParser, json_objects

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ReparsingToolParser):
    examples = ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
                '<|python_tag|>{"name": "f", "parameters": {"a": "x;y"}}; {"name": "g", "parameters": {}}')

    def parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        body = text.lstrip()
        if body.startswith(TAG):
            body = body[len(TAG):]
        elif not body.startswith("{"):
            if not final and TAG.startswith(body):
                return "", []  # it may still become the tag
            return text, []
        return json_objects(body, ";", None, final)

