"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`.

A gRPC status becomes the HTTP status that means the same thing, and a control plane's
`INVALID_ARGUMENT` detail (`sampling.top_p: must be in (0, 1], got 1.5`) names the OpenAI field.
"""

from __future__ import annotations

from typing import Any

import grpc

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}
# The protocol's field names in INVALID_ARGUMENT details, and the OpenAI fields they come from.
OPENAI_FIELDS = {
    "text": "prompt",
    "input_ids": "prompt",
    "sampling.max_new_tokens": "max_tokens",
    "sampling.min_new_tokens": "min_tokens",
    "sampling.stop_token_ids": "stop_token_ids",
    "routing_key": "user",
}


class GatewayError(Exception):
    """A request the gateway answers with an error body; `status` is the HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        # The Retry-After header's value (a control plane's `retry-after` trailer), if any.
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": self.retry_after} if self.retry_after else {}

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def invalid(param: str, problem: str) -> GatewayError:
    """400 naming the field: `max_tokens: must be >= 0, got -1`."""
    return GatewayError(400, f"{param}: {problem}", param=param)


# gRPC's own refusals of a request too large for the control plane's client port: RESOURCE_EXHAUSTED,
# but no retry will fit, so not 429 (its details, as gRPC core words them).
TOO_LARGE = {"Received message larger than max": 413, "received metadata size exceeds": 431}


def from_grpc(exc: grpc.aio.AioRpcError) -> GatewayError:
    """The error a refused or failed gRPC call becomes (500 for codes with no better match)."""
    status = HTTP_STATUS.get(exc.code(), 500)
    details = exc.details() or exc.code().name
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        status = next((s for words, s in TOO_LARGE.items() if words in details), status)
    param = None
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and ":" in details:
        field, rest = details.split(":", 1)
        if " " not in field:
            param = openai_field(field)
            details = f"{param}:{rest}"
    retry_after = _trailer(exc, "retry-after") if status == 429 else None
    return GatewayError(status, details, param=param, code=exc.code().name.lower(), retry_after=retry_after)


def _trailer(exc: grpc.aio.AioRpcError, name: str) -> str | None:
    """A trailer's value when it is whole seconds (anything else is not passed on to HTTP)."""
    metadata = exc.trailing_metadata()
    value = metadata.get(name) if metadata is not None else None  # type: ignore[attr-defined]
    return value if isinstance(value, str) and value.isdigit() else None


def openai_field(field: str) -> str:
    """`sampling.top_p` -> `top_p`; `text` -> `prompt`."""
    if field in OPENAI_FIELDS:
        return OPENAI_FIELDS[field]
    return field.removeprefix("sampling.")
