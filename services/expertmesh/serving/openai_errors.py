"""Errors of the HTTP API in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``
with the HTTP status an OpenAI SDK turns into the matching exception.

Engine and validation errors carry gRPC status codes (``expertmesh.contracts.errors``);
``ApiError.from_grpc`` maps them, so both APIs refuse the same request for the
same reason: INVALID_ARGUMENT 400, NOT_FOUND 404, RESOURCE_EXHAUSTED 429 (SDKs
retry it), UNAVAILABLE 503 (also while draining), DEADLINE_EXCEEDED 504,
anything else 500.
"""

from __future__ import annotations

import grpc
from pydantic import ValidationError
from starlette.responses import JSONResponse

from expertmesh.serving.events import ErrorEvent
from expertmesh.serving.openai_responses import ErrorDetail, ErrorResponse

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

# OpenAI's error types by HTTP status; SDKs key on the status, people read the type.
_TYPE = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}

# pydantic's error types that mean "wrong JSON type" rather than "wrong value"
_TYPE_ERRORS = {
    "model_type",
    "dict_type",
    "list_type",
    "string_type",
    "int_type",
    "float_type",
    "bool_type",
    "invalid_type",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, message: str, param: str | None = None) -> ApiError:
        return cls(_STATUS.get(code, 500), message, param=param, code=code.name.lower())

    @classmethod
    def from_event(cls, event: ErrorEvent) -> ApiError:
        """An engine's error event (its failure named as gRPC names its codes)."""
        return cls.from_grpc(grpc.StatusCode[event.failure.value], event.message)

    @classmethod
    def from_validation(cls, err: ValidationError) -> ApiError:
        """The first problem names the field (``param``); the message lists them all."""
        problems = err.errors(include_url=False)
        first = problems[0]
        kind = first["type"]
        if kind == "json_invalid":
            return cls.bad_request(f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
        if not first["loc"]:
            return cls.bad_request(f"the request body must be a JSON object: {first['msg']}", code="invalid_type")
        code = (
            "missing_required_parameter"
            if kind == "missing"
            else "invalid_type"
            if kind in _TYPE_ERRORS
            else kind
            if kind.startswith("unsupported_")
            else "invalid_value"
        )
        message = "; ".join(f"{_param(p['loc'])}: {p['msg']}" for p in problems)
        return cls.bad_request(message, param=_param(first["loc"]), code=code)

    def body(self) -> ErrorResponse:
        kind = _TYPE.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return ErrorResponse(error=ErrorDetail(message=self.message, type=kind, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(mode="json"), status_code=self.status)


def _param(loc: tuple) -> str:
    """("messages", 0, "content") -> "messages[0].content", as OpenAI names nested fields."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out
