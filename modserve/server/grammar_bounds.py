"""Refuse a constraint whose automaton would be too large, before any backend compiles it.

A backend's compile time and memory grow with what a spec expands to: ``a{100000}``
is a hundred thousand DFA states to outlines-core, a 100,000-entry enum or choice
list as many branches to xgrammar, a 5,000-deep schema a recursion in every walker.
A compile past its time or memory is killed (its worker process), but that costs the
request its answer and a worker its start; so a spec is measured here first (linear
in its text; nesting is measured on the text, before anything recursive reads it)
and refused with a message naming the bound it is over. Each bound is a config key
(``grammar_max_*``); the defaults pass every schema, regex and grammar of the real
corpora the tests read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from modserve.core.structured_outputs import GrammarSpec
from modserve.plugins.grammars.expansion import SATURATE, Shape, grammar_shape, json_depth, regex_shape


@dataclass(frozen=True, slots=True)
class GrammarBounds:
    """The largest constraint the server compiles (the ``grammar_max_*`` config keys)."""

    max_size: int
    max_repetition: int
    max_depth: int
    max_alternatives: int

    @classmethod
    def from_config(cls, config: Any) -> GrammarBounds:
        return cls(config.grammar_max_size, config.grammar_max_repetition, config.grammar_max_depth,
                   config.grammar_max_alternatives)


_WHAT = (("depth", "nests {} levels deep"), ("alternatives", "has {} alternatives in one place"),
         ("repetition", "repeats a part {} times"), ("size", "expands to about {} positions"))


def check_bounds(spec: GrammarSpec, bounds: GrammarBounds) -> None:
    """A ValueError naming the first bound ``spec`` is over; returns when it is within all."""
    if spec.kind == "json":
        depth = json_depth(spec.value)  # before json.loads, whose recursion a deep text overflows
        shape = Shape(depth=depth) if depth > bounds.max_depth else schema_shape(json.loads(spec.value))
        shape.depth = depth
    elif spec.kind == "regex":
        shape = regex_shape(spec.value)
    elif spec.kind == "grammar":
        shape = grammar_shape(spec.value)
    elif spec.kind == "choice":
        shape = Shape(size=sum(len(c) for c in spec.value), alternatives=len(spec.value))
    else:
        return
    for measure, what in _WHAT:
        value, bound = getattr(shape, measure), getattr(bounds, f"max_{measure}")
        if value > bound:
            where = (shape.where or {}).get(measure)
            at = f" at {where}" if where else ""
            raise ValueError(f"the {spec.kind} constraint {what.format(value)}{at}, over "
                             f"grammar_max_{measure}={bound}")


_SUB_ONE = ("additionalProperties", "not", "if", "then", "else", "propertyNames", "unevaluatedProperties",
            "items", "additionalItems", "contains", "unevaluatedItems")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUB_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def schema_shape(schema: Any) -> Shape:
    """The expansion of a parsed schema: a node is a position, a ``$ref`` target counted once
    (backends make it one rule), an enum or const its JSON text; counts (``maxLength``,
    ``maxItems``) are each a repetition, not multiplied through nested arrays (the backends
    that take JSON keep a count as a counter, not as copies)."""
    shape = Shape()
    refs: set[str] = set()
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        shape.size += 1
        for key in _COUNTS:
            value = node.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                shape.note("repetition", min(value, SATURATE), f"{where}/{key}")
        if isinstance(node.get("pattern"), str):
            inner = regex_shape(node["pattern"])
            for measure in ("repetition", "alternatives"):
                shape.note(measure, getattr(inner, measure), f"{where}/pattern")
            shape.size = min(shape.size + inner.size, SATURATE)
        for key in ("enum", "const"):
            if key in node:
                values = node[key] if key == "enum" and isinstance(node[key], list) else [node[key]]
                shape.note("alternatives", len(values), f"{where}/{key}")
                shape.size += len(json.dumps(values))
        for key in _SUB_ONE:
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{where}/{key}"))
        for key in _SUB_MAP:
            members = node.get(key)
            if isinstance(members, dict):
                if key == "properties":  # optional properties: each may follow any before it
                    shape.note("alternatives", len(members), f"{where}/{key}")
                stack.extend((sub, f"{where}/{key}/{name}") for name, sub in members.items())
        for key in _SUB_LIST:
            members = node.get(key)
            if isinstance(members, list):
                shape.note("alternatives", len(members), f"{where}/{key}")
                stack.extend((sub, f"{where}/{key}/{i}") for i, sub in enumerate(members))
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and ref not in refs:
            refs.add(ref)
            stack.append((_pointer(schema, ref), ref))
    return shape


def _pointer(root: Any, ref: str) -> Any:
    target = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target
