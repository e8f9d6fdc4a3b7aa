"""What a request constrains its output to: one JSON schema, regex, choice list or grammar.

``StructuredOutputs`` is what users write (offline, or translated from the HTTP
fields); ``GrammarSpec`` is its canonical, hashable form that backends compile and
the core's cache is keyed on.
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, fields
from typing import Any, Literal

GrammarKind = Literal["json", "regex", "choice", "grammar", "json_object"]
KINDS: tuple[str, ...] = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint in canonical form.

    ``value`` by kind: ``json``: the schema as compact JSON text (key order kept: it is
    the order properties are generated in); ``regex`` and ``grammar``: the text;
    ``choice``: a tuple of strings; ``json_object``: None (any JSON object).
    """

    kind: GrammarKind
    value: str | tuple[str, ...] | None

    def describe(self, limit: int = 80) -> str:
        text = repr(self.value)
        return f"{self.kind} {text if len(text) <= limit else text[:limit] + '...'}"


@dataclass(slots=True)
class StructuredOutputs:
    """Exactly one constraint, as vLLM's ``StructuredOutputsParams``:

    ``json`` (a schema, as a dict or JSON text), ``regex`` (the whole output must
    match), ``choice`` (the output is one of these strings), ``grammar`` (EBNF/GBNF
    with a ``root`` rule), ``json_object=True`` (any JSON object).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # Not a constraint: token ids after which the constraint starts (before them any token goes).
    # The server sets it to the reasoning parser's end marker (``</think>``); not in spec(), so
    # not in the compiled grammar's cache key.
    start_after: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in _constraints(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            which = f"got {len(given)}: {', '.join(given)}" if given else "got none"
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; {which}")
        self.spec()  # malformed values fail here, when the request is made

    @property
    def kind(self) -> GrammarKind:
        return next(f.name for f in _constraints(self) if getattr(self, f.name) not in (None, False))  # type: ignore

    def spec(self) -> GrammarSpec:
        kind = self.kind
        if kind == "json":
            return GrammarSpec("json", _canonical_schema(self.json))
        if kind == "choice":
            choices = self.choice
            if not isinstance(choices, (list, tuple)) or not choices or not all(
                    isinstance(c, str) and c for c in choices):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            return GrammarSpec("choice", tuple(choices))
        if kind == "json_object":
            return GrammarSpec("json_object", None)
        text = getattr(self, kind)
        if not isinstance(text, str) or not text:
            raise ValueError(f"{kind} must be a non-empty string")
        return GrammarSpec(kind, text)


def _constraints(so: StructuredOutputs) -> list[Any]:
    return [f for f in fields(so) if f.name != "start_after"]


def _canonical_schema(schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = jsonlib.loads(schema)
        except ValueError as e:
            raise ValueError(f"json: the schema is not valid JSON: {e}") from None
        except RecursionError:  # the parser recurses per level: a deep text overflows it
            raise ValueError("json: the schema nests too deeply to be read") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json: a schema must be a JSON object, got {type(schema).__name__}")
    try:
        return jsonlib.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except (RecursionError, ValueError, TypeError) as e:  # too deep, a cycle, or not JSON data
        raise ValueError(f"json: the schema cannot be written as JSON ({type(e).__name__})") from None
