"""Why a request was not admitted: the reason, its HTTP status and OpenAI code, and the arithmetic."""

from __future__ import annotations

from typing import Any

# reason -> (HTTP status, OpenAI error code, OpenAI error type); SPEC.md's error table.
REJECTIONS: dict[str, tuple[int, str, str]] = {
    "kv_unservable": (400, "context_length_exceeded", "invalid_request_error"),
    "queue_full": (429, "queue_full", "rate_limit_error"),
    "kv_timeout": (503, "kv_timeout", "service_unavailable_error"),
    "model_reloading": (503, "model_reloading", "service_unavailable_error"),
}


class AdmissionRejected(Exception):
    """A request the controller will not run (now, or ever), with everything the server needs to answer.

    - `reason`: one of `REJECTIONS` (`kv_unservable`, `queue_full`, `kv_timeout`, `model_reloading`).
    - `status`, `code`: the HTTP status and OpenAI error code SPEC.md assigns to that reason.
    - `message`: a sentence with the numbers, for the client.
    - `retry_after`: whole seconds (>= 1) until a retry is estimated to be admitted, or `None`
      for a permanent rejection (`kv_unservable`).
    - `arithmetic`: the numbers the decision used (prompt, max_tokens, blocks needed/available/
      reserved/total, queue depth, estimated wait, deadline), as logged.
    """

    def __init__(self, reason: str, message: str, retry_after: int | None, arithmetic: dict[str, Any]) -> None:
        if reason not in REJECTIONS:
            raise ValueError(f"unknown admission rejection reason {reason!r}; expected one of {sorted(REJECTIONS)}")
        if reason == "kv_unservable" and retry_after is not None:
            raise ValueError("kv_unservable is permanent: retry_after must be None")
        if reason != "kv_unservable" and (retry_after is None or retry_after < 1):
            raise ValueError(f"{reason} needs an estimated retry_after >= 1, got {retry_after!r}")
        super().__init__(message)
        self.reason = reason
        self.status, self.code, self.error_type = REJECTIONS[reason]
        self.message = message
        self.retry_after = retry_after
        self.arithmetic = dict(arithmetic)

    @property
    def permanent(self) -> bool:
        """True when retrying the same request can never succeed on this node."""
        return self.retry_after is None

    def headers(self) -> dict[str, str]:
        """HTTP headers for the response: `Retry-After` when the rejection is temporary."""
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def openai_error(self) -> dict[str, Any]:
        """The OpenAI-shaped body: `{"error": {"message", "type", "code", "param"}}`."""
        return {"error": {"message": self.message, "type": self.error_type, "code": self.code, "param": None}}

    def __repr__(self) -> str:
        return f"AdmissionRejected({self.reason!r}, status={self.status}, retry_after={self.retry_after!r})"


class AdmissionIntegrityError(RuntimeError):
    """The controller's bookkeeping broke one of its invariants (a bug, never a user error)."""
