"""Constraints that are slow to compile on purpose, for the tests of compile time limits."""

from __future__ import annotations


def deep_schema(depth: int) -> dict:
    """A JSON schema whose xgrammar grammar grows about 3x a level: depth 8 compiles in a
    fraction of a second to a ~300 MB grammar, 11 takes seconds, 13 far past any timeout."""
    schema: dict = {"type": "string"}
    for i in range(depth):
        schema = {"type": "object", "required": [f"k{i}"], "properties": {
            f"k{i}": schema, f"a{i}": {"anyOf": [{"type": "integer"}, {"type": "array", "items": schema}]}}}
    return schema
