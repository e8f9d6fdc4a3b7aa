"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class APIError(Exception):
    """Raised anywhere in a route; the app turns it into an OpenAI error response."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        message, param = _printable(message), _printable(param)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _printable(text: str | None) -> str | None:
    """``text`` with lone surrogates (from the request that is refused) as \\ud800 escapes:
    they cannot be written as UTF-8, and the error about them must still go out."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid(param: str | None, message: str) -> APIError:
    """400 for a bad field; the message starts with the field's name so it reads on its own."""
    text = f"{param}: {message}" if param and not message.startswith(param + " ") else message
    return APIError(400, text, param=param, code="invalid_value")


def _union_tag(part: object) -> bool:
    """pydantic names the member of a union it tried ('str', 'list[TextPart]',
    'function-after[...]') in the error's path; a client's field path has no such part."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def from_validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, named by its field path (``messages.0.role``)."""
    errors = exc.errors()
    if not errors:
        return invalid(None, "invalid request")
    err = errors[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}",
                        code="invalid_json")
    loc = [str(p) for p in err["loc"] if p != "body" and not _union_tag(p)]
    if not loc:
        # A missing or non-object body, or a check across fields without a single owner.
        what = "request body must be a JSON object" if err["type"] in ("missing", "model_attributes_type",
                                                                       "dict_type") else err["msg"]
        return invalid(None, what)
    param = ".".join(loc)
    if err["type"] == "extra_forbidden":
        return invalid(param, "unknown or unsupported field")
    message = err["msg"].removeprefix("Value error, ")
    return invalid(param, message)
