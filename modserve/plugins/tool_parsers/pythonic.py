"""Pythonic calls (Llama 3.2 and 4 with their pythonic templates, ToolACE): the whole output is a Python
list of calls with literal keyword arguments, ``[f(a=1), g(b="x")]``; anything else is content."""

from __future__ import annotations

import ast
import json
import re

from modserve.api.tool_parsing import PartialCall, ReparsingToolParser

WRAP = ("<|python_start|>", "<|python_end|>")  # Llama 4 may wrap the list
_NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")


class PythonicToolParser(ReparsingToolParser):
    examples = ('[get_weather(city="Paris")]', '[f(a=1, b=[1, 2]), g(s="x, y)")]',
                '<|python_start|>[f(a=None)]<|python_end|>')

    def parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        body = text.strip()
        if body.startswith(WRAP[0]):
            body = body[len(WRAP[0]):].strip()
        elif not final and WRAP[0].startswith(body):
            return "", []
        if final:
            calls = _calls(body.removesuffix(WRAP[1]).strip())
            return ("", calls) if calls is not None else (text, [])
        if not body.startswith("["):
            return ("", []) if not body and text.strip() else (text, [])
        return "", _partial_calls(body)


def _call(node: ast.expr) -> PartialCall:
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
        raise ValueError("not a call with keyword arguments")
    args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    return PartialCall(ast.unparse(node.func), json.dumps(args, ensure_ascii=False))


def _calls(body: str) -> list[PartialCall] | None:
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        return [_call(e) for e in tree.elts]
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


def _partial_calls(body: str) -> list[PartialCall]:
    """The calls of an unfinished list: whole elements parsed, the one under way by its name only."""
    calls, depth, quote, start, i = [], 0, "", 1, 0
    while i < len(body):
        c = body[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if not quote and ((c == "," and depth == 1) or depth == 0):
            element = _calls(f"[{body[start:i]}]")
            if element:
                calls += element
            start = i + 1
            if depth == 0:
                return calls
        i += 1
    m = _NAME.match(body, start)
    return calls + ([PartialCall(m.group(1), "")] if m else [])
