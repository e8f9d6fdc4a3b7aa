"""The OpenAPI schema, made to say what the server really accepts and returns.

FastAPI's generated schema declares a 422 the app never sends (validation errors
become 400s in OpenAI's shape), none of the errors it does send, only JSON for the
two routes that also stream, and any value at all for a completion's prompt.
Clients generated from the schema, and fuzzers checking responses against it,
need the truth.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from modserve.server.generate import GenerateResponse, GenerateStreamResponse
from modserve.server.protocol import ChatCompletionChunk, ChatCompletionResponse, CompletionResponse
from modserve.server.responses_protocol import ResponseEvent, ResponseObject

_REF = "#/components/schemas/{model}"

# modserve.server.errors.APIError.body(): every error response, whoever raised it.
_ERROR_RESPONSE: dict[str, Any] = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
        },
    },
}

# The routes an API key guards (every one but /health, /metrics, /version, /load and the docs).
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/inference/")

# Route -> (its JSON body, one event of its stream). An event's data is a chunk, an
# error met mid-stream, or the closing "[DONE]".
_GENERATION: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "/v1/completions": (CompletionResponse, CompletionResponse),
    "/v1/chat/completions": (ChatCompletionResponse, ChatCompletionChunk),
    "/inference/v1/generate": (GenerateResponse, GenerateStreamResponse),
    "/v1/responses": (ResponseObject, ResponseEvent),
}

Operation = dict[str, Any]


def _always(path: str, op: Operation) -> bool:
    return True


def _has_body(path: str, op: Operation) -> bool:
    return "requestBody" in op


def _names_model(path: str, op: Operation) -> bool:
    # every request body has an optional `model`; a stored response's id may be unknown
    return "{model}" in path or "{response_id}" in path or _has_body(path, op)


def _protected(path: str, op: Operation) -> bool:
    return path.startswith(PROTECTED_PREFIXES)


# status -> (description, which operations can return it).
_ERRORS: dict[int, tuple[str, Callable[[str, Operation], bool]]] = {
    # Any route: modserve.server.http_hygiene refuses ambiguous headers before routing.
    400: ("Invalid request: a bad or unknown field, malformed JSON, or ambiguous headers", _always),
    401: ("Missing or wrong API key (only when the server has one)", _protected),
    404: ("The model named is not the one served, or no stored response has the id", _names_model),
    # modserve.server.limits reads every request's body, whatever the route, before routing.
    408: ("The request body did not arrive in time", _always),
    413: ("Request body too large", _always),
    500: ("Server error", _always),
    # Any route while the server shuts down; generation also when overloaded or the engine died.
    503: ("Overloaded, shutting down, or the engine is not running", _always),
}

# CompletionRequest._prompt_shape's rule; pydantic sees only ``Any``.
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_PROMPT = {"title": "Prompt", "anyOf": [
    {"type": "string"},
    {"type": "array", "minItems": 1, "items": {"type": "string"}},
    _TOKEN_IDS,
    {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
]}

# A plain and a streamed request per route: documentation, and schemathesis's examples
# phase then exercises both response media types on every run.
_HELLO = [{"role": "user", "content": "Hello"}]
_STREAM = {"stream": True, "stream_options": {"include_usage": True}}
_EXAMPLES: dict[str, dict[str, dict[str, Any]]] = {
    "/v1/completions": {"plain": {"prompt": "Hello", "max_tokens": 8},
                        "stream": {"prompt": "Hello", "max_tokens": 8, **_STREAM}},
    "/v1/chat/completions": {"plain": {"messages": _HELLO, "max_tokens": 8},
                             "stream": {"messages": _HELLO, "max_tokens": 8, **_STREAM}},
    "/tokenize": {"prompt": {"prompt": "Hello"}, "messages": {"messages": _HELLO}},
    "/detokenize": {"tokens": {"tokens": [1, 2, 3]}},
    "/v1/responses": {"plain": {"input": "Hello", "max_output_tokens": 8},
                      "stream": {"input": "Hello", "max_output_tokens": 8, "stream": True}},
}

_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}},
    503: {"Retry-After": {"description": "Seconds to wait, when overloaded", "schema": {"type": "string"}}},
}


def declare_errors(app: FastAPI) -> None:
    """Replace ``app.openapi`` with FastAPI's generator followed by the fixes above, cached."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            # FastAPI's generator caches its result in app.openapi_schema; fixing it in
            # place makes the cached copy the declared one.
            _declare(generate())
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def _declare(schema: dict[str, Any]) -> None:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = _ERROR_RESPONSE
    _add_models(components, [m for pair in _GENERATION.values() for m in pair])
    _declare_errors(schema["paths"])
    _declare_streams(schema["paths"])
    _declare_requests(schema["paths"], components)
    _fix_plain_routes(schema["paths"])
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)  # only the 422s named them


def _declare_errors(paths: dict[str, Any]) -> None:
    for path, ops in paths.items():
        for op in ops.values():
            responses = op["responses"]
            responses.pop("422", None)
            for status, (description, applies) in _ERRORS.items():
                if applies(path, op):
                    responses[str(status)] = _error(description, _HEADERS.get(status))


def _declare_streams(paths: dict[str, Any]) -> None:
    """A 200 is the JSON body, or with ``stream: true`` server-sent events."""
    for path, (body, chunk) in _GENERATION.items():
        if path in paths:
            paths[path]["post"]["responses"]["200"]["content"] = {
                "application/json": {"schema": {"$ref": _REF.format(model=body.__name__)}},
                "text/event-stream": {"schema": _sse_event(chunk)},
            }


def _declare_requests(paths: dict[str, Any], components: dict[str, Any]) -> None:
    if "CompletionRequest" in components:
        components["CompletionRequest"]["properties"]["prompt"] = _PROMPT
    for path, examples in _EXAMPLES.items():
        body = paths.get(path, {}).get("post", {}).get("requestBody")
        if body is not None:
            body["content"]["application/json"]["examples"] = {
                name: {"value": value} for name, value in examples.items()}


def _add_models(components: dict[str, Any], models: list[type[BaseModel]]) -> None:
    """The response models the routes build by hand (FastAPI sees only ``Response``)."""
    _, top = models_json_schema([(m, "serialization") for m in dict.fromkeys(models)], ref_template=_REF)
    for name, model_schema in top.get("$defs", {}).items():
        components.setdefault(name, model_schema)


def _error(description: str, headers: dict[str, Any] | None) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}},
    }
    if headers:
        response["headers"] = headers
    return response


def _sse_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1: a text/event-stream ``schema`` describes each event)."""
    json_data = {
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [{"$ref": _REF.format(model=chunk.__name__)},
                                    {"$ref": _REF.format(model="ErrorResponse")}]},
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
    }


def _fix_plain_routes(paths: dict[str, Any]) -> None:
    """/metrics is Prometheus text, and /health's body is fixed; FastAPI sees only ``Response``."""
    stored = paths.get("/v1/responses/{response_id}", {}).get("get")
    if stored is not None:
        stored["responses"]["200"]["content"] = {"application/json": {"schema": {
            "$ref": _REF.format(model="ResponseObject")}}}
    if "/metrics" in paths:
        paths["/metrics"]["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    if "/health" in paths:
        paths["/health"]["get"]["responses"]["200"]["content"] = {"application/json": {"schema": {
            "type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}}}}
