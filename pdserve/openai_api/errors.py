"""Errors in the OpenAI error shape, {"error": {message, type, param, code}}: the router answers them
over HTTP and the batch job writes them into a line's result."""

from __future__ import annotations

import math
from typing import Sequence

from fastapi.responses import JSONResponse


class OpenAIError(Exception):
    """An error with an HTTP status and an OpenAI error body."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


class BadRequest(OpenAIError):
    status, type, code = 400, "invalid_request_error", None


class UpstreamInvalidRequest(BadRequest):
    """A node refused the request as invalid (gRPC INVALID_ARGUMENT)."""


class Unauthorized(OpenAIError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"


class ModelNotFound(OpenAIError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class PayloadTooLarge(OpenAIError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class RequestTimeout(OpenAIError):
    """The request body did not arrive in time (a slow-body drip)."""

    status, type, code = 408, "invalid_request_error", "request_timeout"


class NoCapacityError(OpenAIError):
    """No healthy prefill+decode pair, or no decode node can fit the request. `retry_after`: seconds
    a client should wait before trying again (the HTTP `Retry-After` header)."""

    status, type, code = 503, "server_error", "no_capacity"

    def __init__(self, message: str, param: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message, param)
        self.retry_after = retry_after


class RateLimited(OpenAIError):
    """An API key is over its in-flight or per-minute limit (OpenAI's 429 shape, with Retry-After)."""

    status, type, code = 429, "requests", "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class UpstreamError(OpenAIError):
    status, type, code = 502, "server_error", "upstream_error"


def validation_message(errors: Sequence) -> tuple[str, str | None]:
    """The first pydantic error of a body as the API words it: (`loc: msg`, param = loc); FastAPI's
    leading "body" is dropped, and a body that is not JSON says so."""
    first = dict(errors[0]) if errors else {}
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    loc = ".".join(str(x) for x in first.get("loc", []) if x != "body")
    return f"{loc or 'body'}: {first.get('msg', 'invalid value')}", loc or None


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def retry_after_header(err: OpenAIError) -> str | None:
    """The `Retry-After` value (whole seconds, at least 1) of an error that says when to retry."""
    retry_after = getattr(err, "retry_after", None)
    return str(max(1, math.ceil(retry_after))) if retry_after is not None else None


def error_response(err: OpenAIError) -> JSONResponse:
    retry_after = retry_after_header(err)
    headers = {"Retry-After": retry_after} if retry_after is not None else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def bearer_key(authorization: bytes) -> bytes:
    """The key of an `Authorization: Bearer <key>` header value (b"" for any other scheme)."""
    return authorization[7:].strip() if authorization[:7].lower() == b"bearer " else b""
