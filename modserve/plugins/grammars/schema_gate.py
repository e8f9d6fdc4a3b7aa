"""Refuse JSON schemas that use a constraint the backend would silently not enforce.

Both libraries skip some keywords without a word (xgrammar: ``uniqueItems``,
``not``, ``if``; outlines-core: ``minimum``, ``maxProperties``, ...), and then a
"valid" output can fail validation. A backend instead refuses such a schema,
naming the keyword and where it is, and ``auto`` moves on to the next backend.
The lists come from probing each keyword with an instance that violates it
(tests/test_grammar_backends.py keeps those probes, so a library upgrade that
changes behaviour shows up).
"""

from __future__ import annotations

import json
from typing import Any, Iterator

# Where keywords hold sub-schemas; every other keyword's value is data (enum, const, default, ...).
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")

# Values that constrain nothing, so the keyword may stay even where it is not enforced.
_NO_OP = (False, None, {}, [], 0)


def unenforced(schema: Any, keywords: frozenset[str], formats: frozenset[str] = frozenset(),
               pairs: frozenset[tuple[str, str]] = frozenset(), pointer_refs_only: bool = False) -> str | None:
    """The first constraint in ``schema`` its backend would skip, as "keyword at path"; None if none.

    ``keywords`` are skipped keywords; ``oneOf`` listed there is allowed when its
    branches provably never overlap (then any-of is one-of); ``allOf`` when it has a
    single branch. ``formats`` are ``format`` values the backend does not enforce,
    ``pairs`` keywords it drops the second of when both are present, and
    ``pointer_refs_only`` says a ``$ref`` other than ``#`` or ``#/...`` is skipped.
    """
    for path, node in _schemas(schema, "#"):
        for first, second in pairs:
            if first in node and second in node:
                return f"{second!r} together with {first!r} at {path}"
        ref = node.get("$ref")
        if pointer_refs_only and isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
            return f"$ref {ref!r} (only '#/...' pointers) at {path}"
        for key, value in node.items():
            if key == "format" and value in formats:
                return f"format {value!r} at {path}"
            if key not in keywords or value in _NO_OP:
                continue
            if key == "oneOf" and _disjoint(value, schema):
                continue
            if key == "allOf" and isinstance(value, list) and len(value) == 1:
                continue
            return f"{key!r} at {path}"
    return None


def _schemas(node: Any, path: str) -> Iterator[tuple[str, dict]]:
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _ONE:
        if isinstance(node.get(key), dict):
            yield from _schemas(node[key], f"{path}/{key}")
    for key in _MAP:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield from _schemas(sub, f"{path}/{key}/{name}")
    for key in _LIST:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield from _schemas(sub, f"{path}/{key}/{i}")


def _disjoint(branches: Any, root: Any) -> bool:
    """True when no instance can match two branches: their JSON types never overlap,
    or all are objects that require one property with a different constant each."""
    if not isinstance(branches, list):
        return False
    resolved = [_resolve(b, root) for b in branches]
    kinds = [_types(b) for b in resolved]
    if all(k is not None for k in kinds):
        seen: set[str] = set()
        for k in kinds:
            if seen & k:
                break
            seen |= k
        else:
            return True
    tags = [_tags(b) for b in resolved]
    for prop in set.intersection(*(set(t) for t in tags)) if tags else ():
        values = [tags_of[prop] for tags_of in tags]
        if all(v is not None for v in values) and len(set().union(*values)) == sum(len(v) for v in values):
            return True
    return False


def _resolve(node: Any, root: Any, depth: int = 0) -> Any:
    ref = node.get("$ref") if isinstance(node, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#") or depth > 8:
        return node
    target = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return node
        target = target[part]
    return _resolve(target, root, depth + 1)


def _types(node: Any) -> set[str] | None:
    """The JSON types a schema admits, or None when it does not say."""
    if not isinstance(node, dict):
        return None
    values = [node["const"]] if "const" in node else node.get("enum")
    if isinstance(values, list):
        return {_type_of(v) for v in values}
    t = node.get("type")
    names = [t] if isinstance(t, str) else t if isinstance(t, list) else None
    if not names:
        return None
    out = set(names)
    if "number" in out:
        out.add("integer")  # 1 is both
    return out


def _type_of(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "boolean" if isinstance(value, bool) else "null"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def _tags(node: Any) -> dict[str, frozenset[str] | None]:
    """Required properties with constant values, by name (values as JSON text)."""
    if not isinstance(node, dict) or not isinstance(node.get("properties"), dict):
        return {}
    out = {}
    for name in node.get("required") or []:
        prop = node["properties"].get(name)
        values = None
        if isinstance(prop, dict):
            values = [prop["const"]] if "const" in prop else prop.get("enum")
        out[name] = frozenset(json.dumps(v, sort_keys=True) for v in values) if isinstance(values, list) else None
    return out
