"""The HTTP spellings of an output constraint, reduced to one ``StructuredOutputs``.

Accepted, as vLLM does: ``structured_outputs: {json | regex | choice | grammar |
json_object}``, the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``, and OpenAI's ``response_format`` (``json_object``,
``json_schema``). A request may carry one constraint; two are a 400 naming both.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from modserve.core.structured_outputs import StructuredOutputs
from modserve.server.errors import invalid


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False, strict=True)


class StructuredOutputsParams(_Strict):
    json_: dict[str, Any] | str | None = Field(None, alias="json")  # "json" would shadow BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class JSONSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ConstraintFields(_Strict):
    """The request fields that constrain the output; completions and chat both take them."""

    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: ResponseFormat | None = None
    _constraint: tuple[str, StructuredOutputs] | None = PrivateAttr(None)

    def check_constraint(self) -> None:
        """Reduce the fields to one constraint, or raise a 400 naming the field at fault."""
        given: list[tuple[str, dict[str, Any]]] = []
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(exclude_none=True)
            given.append(("structured_outputs", {k.rstrip("_"): v for k, v in fields.items()}))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                given.append((f"guided_{kind}", {kind: value}))
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise invalid("response_format", "type json_schema needs json_schema.schema")
            given.append(("response_format", {"json": fmt.json_schema.schema_}))
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise invalid(given[1][0], f"a request takes one output constraint, got {len(given)}: {names}")
        if given:
            param, fields = given[0]
            try:
                self._constraint = (param, StructuredOutputs(**fields))
            except ValueError as e:
                raise invalid(param, str(e)) from None
            except Exception as e:  # any parser of client input: a 400 naming the field, never a 500
                raise invalid(param, f"could not be read ({type(e).__name__})") from None

    def enforce(self, param: str, constraint: StructuredOutputs) -> None:
        """A constraint the server derives from another field (tool_choice), as if it were given."""
        self._constraint = (param, constraint)

    @property
    def constraint(self) -> StructuredOutputs | None:
        return self._constraint[1] if self._constraint else None

    @property
    def constraint_param(self) -> str | None:
        return self._constraint[0] if self._constraint else None
