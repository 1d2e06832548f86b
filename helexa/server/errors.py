"""OpenAI-shaped errors, `{"error": {"message", "type", "code", "param"}}`: every status and code the
server sends is decided here, admission's rejections included (`from_admission`)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from helexa.admission import AdmissionRejected

# Admission's rejection reason -> (HTTP status, OpenAI error code, OpenAI error type).
ADMISSION_ERRORS: dict[str, tuple[int, str, str]] = {
    "kv_unservable": (400, "context_length_exceeded", "invalid_request_error"),  # permanent: no Retry-After
    "queue_full": (429, "queue_full", "rate_limit_error"),
    "kv_timeout": (503, "kv_timeout", "service_unavailable_error"),
    "model_reloading": (503, "model_reloading", "service_unavailable_error"),
}

# code -> (HTTP status, OpenAI error type) for the errors the server itself decides.
_SERVER_ERRORS: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),  # text too long to fit, found before tokenising
    "invalid_api_key": (401, "authentication_error"),
    "not_found": (404, "invalid_request_error"),
    "model_not_found": (404, "invalid_request_error"),  # GET /v1/models/{id} of a model not served
    "method_not_allowed": (405, "invalid_request_error"),
    "request_timeout": (408, "invalid_request_error"),
    "request_too_large": (413, "invalid_request_error"),
    "unsupported_media_type": (415, "invalid_request_error"),
    "request_aborted": (503, "service_unavailable_error"),
    "shutting_down": (503, "service_unavailable_error"),
    "overloaded": (503, "service_unavailable_error"),
    "device_fault": (500, "server_error"),
    "internal_error": (500, "server_error"),
    "template_error": (500, "server_error"),  # the served chat template broke (not raise_exception)
}


class APIError(Exception):
    """An error response: HTTP `status`, OpenAI `code` and `type`, a `message`, the offending `param`.

    `retry_after` (whole seconds >= 1) becomes a `Retry-After` header. The server's own codes take
    their status and type from the code; admission's come from `from_admission`.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        status: int | None = None,
        error_type: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        if status is None or error_type is None:
            if code not in _SERVER_ERRORS:
                raise ValueError(f"unknown error code {code!r}: give status and error_type explicitly")
            status, error_type = status or _SERVER_ERRORS[code][0], error_type or _SERVER_ERRORS[code][1]
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        self.status, self.error_type, self.retry_after = status, error_type, retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "code": self.code, "param": self.param}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def __repr__(self) -> str:
        return f"APIError({self.code!r}, status={self.status}, param={self.param!r})"


def from_admission(rejection: AdmissionRejected) -> APIError:
    """The `APIError` for an admission rejection: its reason's status, code and type; its message and Retry-After."""
    status, code, error_type = ADMISSION_ERRORS[rejection.reason]
    return APIError(code, rejection.message, status=status, error_type=error_type, retry_after=rejection.retry_after)


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The JSON response for `error`, with its Retry-After and any extra `headers` (also a raw ASGI app)."""
    return JSONResponse(error.body(), status_code=error.status, headers={**error.headers(), **(headers or {})})
