"""HTTP errors in OpenAI's body (`{"error": {"message", "type", "param", "code"}}`), and the
one mapping from the gateway's status codes to HTTP statuses:

    INVALID_ARGUMENT 400, NOT_FOUND 404, ALREADY_EXISTS 409, RESOURCE_EXHAUSTED 429 (a full
    tier), UNAVAILABLE 503 (no worker can serve, or draining), DEADLINE_EXCEEDED 504,
    anything else 500.
"""
from __future__ import annotations

import logging

import grpc
from fastapi.responses import JSONResponse

from gateway.http.schemas import ErrorBody, ErrorInfo

logger = logging.getLogger(__name__)

_STATUS: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", None),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled_error", None),
}


class HttpError(Exception):
    """Answer the request with `status` and OpenAI's error body; `param` names the field."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(error=ErrorInfo(message=message, type=type, param=param, code=code))

    @classmethod
    def from_status(cls, code: grpc.StatusCode, message: str, param: str | None = None) -> HttpError:
        status, kind, err_code = _STATUS.get(code, (500, "server_error", None))
        return cls(status, message, type=kind, param=param, code=err_code or code.name.lower())

    @classmethod
    def invalid(cls, param: str, why: str) -> HttpError:
        """400 naming the field: the message is '<param>: <why>'."""
        return cls(400, f"{param}: {why}", param=param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status)
