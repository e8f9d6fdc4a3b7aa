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

from modserve.plugins.grammars.dialect import empty_class

# Where keywords hold sub-schemas; every other keyword's value is data (enum, const, default, ...).
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")

# Values that constrain nothing, so the keyword may stay even where it is not enforced.
_NO_OP = {"uniqueItems": False, "minProperties": 0, "minItems": 0, "minLength": 0, "dependencies": {},
          "dependentRequired": {}, "dependentSchemas": {}, "patternProperties": {}}
# Keywords that constrain an instance; anything else (title, description, unknown names) is annotation.
ASSERTIONS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "items", "prefixItems", "additionalItems", "contains",
    "maxItems", "minItems", "uniqueItems", "maxContains", "minContains", "properties", "patternProperties",
    "additionalProperties", "propertyNames", "required", "maxProperties", "minProperties", "dependentRequired",
    "dependentSchemas", "dependencies", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref",
    "unevaluatedProperties", "unevaluatedItems"})
# Both libraries build these from their own value alone, dropping every other keyword beside them.
ALONE = ("anyOf", "oneOf", "allOf", "$ref", "enum", "const")
_OLD_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")  # there, validators ignore $ref's siblings too
# Keywords that only constrain instances of one type.
_TYPE_KEYWORDS = {
    "object": ("properties", "additionalProperties", "required", "patternProperties", "propertyNames",
               "minProperties", "maxProperties"),
    "array": ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "contains", "uniqueItems"),
}


def unenforced(schema: Any, keywords: frozenset[str], formats: frozenset[str] = frozenset(),
               pairs: frozenset[tuple[str, str]] = frozenset(), pointer_refs_only: bool = False,
               type_from_keywords: bool = False, empty_members: bool = False) -> str | None:
    """The first constraint in ``schema`` its backend would skip, as "keyword at path"; None if none.

    ``keywords`` are skipped keywords; ``oneOf`` listed there is allowed when its
    branches provably never overlap (then any-of is one-of); ``allOf`` when it has a
    single branch. ``formats`` are ``format`` values the backend does not enforce,
    ``pairs`` keywords it drops the second of when both are present, and
    ``pointer_refs_only`` says a ``$ref`` other than ``#`` or ``#/...`` is skipped, and
    ``type_from_keywords`` that the backend picks an object or array type from the keywords
    present (``properties``, ``items``) over what ``type`` says, and ``empty_members`` that
    it mishandles ``{}`` (any value) as a property's or ``additionalProperties``' schema.
    """
    old_draft = isinstance(schema, dict) and any(d in str(schema.get("$schema", "")) for d in _OLD_DRAFTS)
    for path, node in _schemas(schema, "#"):
        dropped = _dropped_siblings(node, schema, old_draft)
        if dropped:
            return dropped + f" at {path}"
        for first, second in pairs:
            if first in node and second in node:
                return f"{second!r} together with {first!r} at {path}"
        if type_from_keywords and (clash := _type_clash(node)):
            return clash + f" at {path}"
        if empty_members:
            members = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            empty = [f"properties/{k}" for k, v in members.items() if v == {}]
            empty += ["additionalProperties"] if node.get("additionalProperties") == {} else []
            if empty:
                return f"the any-value schema {{}} as {empty[0]} at {path}"
        ref = node.get("$ref")
        if pointer_refs_only and isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
            return f"$ref {ref!r} (only '#/...' pointers) at {path}"
        for key, value in node.items():
            if key == "format" and value in formats:
                return f"format {value!r} at {path}"
            if key not in keywords or (key in _NO_OP and value == _NO_OP[key] and type(value) is type(_NO_OP[key])):
                continue
            if key == "oneOf" and _disjoint(value, schema):
                continue
            if key == "allOf" and isinstance(value, list) and len(value) == 1:
                continue
            return f"{key!r} at {path}"
    return None


def unmet(schema: Any) -> str | None:
    """The first part of ``schema`` no output could satisfy as the backends build it, as
    "what at path"; None if none. An empty ``enum`` or ``anyOf`` matches nothing (both
    libraries then allow the empty text, which is not JSON), as does a ``pattern`` with a
    class no character is in; a ``required`` name missing
    from ``properties`` is dropped by both (they only write the properties a schema lists)."""
    for path, node in _schemas(schema, "#"):
        for key in ("enum", "anyOf", "oneOf", "allOf"):
            if node.get(key) == []:
                return f"an empty {key!r} (nothing can match it) at {path}"
        if isinstance(node.get("pattern"), str) and (never := empty_class(node["pattern"])):
            return f"a 'pattern' whose class {never} matches no character, at {path}"
        required = node.get("required")
        if isinstance(required, list) and required:
            listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            missing = [name for name in required if name not in listed]
            if missing:
                return f"required {missing[0]!r}, which 'properties' does not list, at {path}"
    return None


def _dropped_siblings(node: dict, root: Any, old_draft: bool) -> str | None:
    """Keywords beside one of ALONE that the backend would drop, unless they add nothing."""
    if old_draft and "$ref" in node:
        return None  # draft 7 and older: validators ignore $ref's siblings as well
    for key in ALONE:
        if key not in node:
            continue
        others = [k for k in node if k in ASSERTIONS and k != key]
        if not others or (others == ["type"] and _type_is_redundant(node, key, root)):
            continue
        return f"{others} beside {key!r} (only {key!r} would count)"
    return None


def _type_clash(node: dict) -> str | None:
    """Object or array keywords in a node whose ``type`` rules that type out."""
    types = _types({"type": node["type"]}) if "type" in node else None
    if types is None:
        return None
    for kind, words in _TYPE_KEYWORDS.items():
        found = [w for w in words if w in node]
        if kind not in types and found:
            return f"{found} beside 'type': {node['type']!r} (they would decide the type)"
    return None


def _type_is_redundant(node: dict, key: str, root: Any) -> bool:
    """``type`` next to ``key``, when every alternative ``key`` allows has one of those types."""
    allowed = _types({"type": node["type"]})
    if key == "const":
        branches = [{"const": node["const"]}]
    elif key == "enum":
        branches = [{"const": v} for v in node["enum"]] if isinstance(node["enum"], list) else []
    elif key == "$ref":
        branches = [_resolve(node, root)]
    else:
        branches = [_resolve(b, root) for b in node[key]] if isinstance(node[key], list) else []
    kinds = [_types(b) for b in branches]
    return bool(branches) and allowed is not None and all(k is not None and k <= allowed for k in kinds)


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
