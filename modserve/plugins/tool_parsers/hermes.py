"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2/3): ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``,
any number of them, with content around them."""

from __future__ import annotations

from modserve.api.tool_parsing import PartialCall, ReparsingToolParser, hold_back, json_call, value_end

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ReparsingToolParser):
    examples = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}\n</tool_call>\n'
                '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')

    def parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        content, calls, pos = [], [], 0
        while True:
            s = text.find(START, pos)
            if s < 0:
                tail = text[pos:]
                content.append(tail if final else hold_back(tail, START))
                return "".join(content), calls
            content.append(text[pos:s])
            body_start = s + len(START)
            e = text.find(END, body_start)
            body = text[body_start:e if e >= 0 else len(text)]
            lead = len(body) - len(body.lstrip())
            end = value_end(body, lead)
            call = json_call(body, complete=end is not None)
            if e >= 0 or final:
                if call is None or call.name is None:  # not a call after all: its text is content
                    content.append(text[s:e + len(END)] if e >= 0 else text[s:])
                else:
                    calls.append(call)
                if e < 0:
                    return "".join(content), calls
                pos = e + len(END)
            else:  # a call under way: the last thing in the text so far
                calls.append(call or PartialCall(None, ""))
                return "".join(content), calls
