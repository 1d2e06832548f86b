"""Why a request was not admitted: the reason, a sentence with the numbers, Retry-After, the arithmetic.

Admission decides *that* and *why*; how a reason becomes an HTTP status is the server's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REJECTION_REASONS = ("queue_full", "kv_timeout", "kv_unservable", "model_reloading")


class AdmissionRejected(Exception):
    """A request admission will not run, now (`retry_after` whole seconds >= 1) or ever (`retry_after` None).

    `reason` is one of `REJECTION_REASONS`; `message` a sentence with the numbers for the client;
    `arithmetic` the numbers the decision used, in the order they are logged.
    """

    def __init__(self, reason: str, message: str, retry_after: int | None, arithmetic: dict[str, Any]) -> None:
        if reason not in REJECTION_REASONS:
            raise ValueError(f"unknown admission rejection reason {reason!r}; expected one of {REJECTION_REASONS}")
        if (reason == "kv_unservable") != (retry_after is None) or (retry_after is not None and retry_after < 1):
            raise ValueError(
                f"{reason}: retry_after must be None for kv_unservable and >= 1 otherwise, got {retry_after!r}"
            )
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        self.arithmetic = dict(arithmetic)

    @property
    def permanent(self) -> bool:
        """True when retrying the same request can never succeed on this node."""
        return self.retry_after is None

    def __repr__(self) -> str:
        return f"AdmissionRejected({self.reason!r}, retry_after={self.retry_after!r})"


def arithmetic_line(arithmetic: dict[str, Any]) -> str:
    """The numbers behind a decision as the `admission: rejected ...` log line writes them: `key=value ...`."""
    return " ".join(f"{k}={v}" for k, v in arithmetic.items())


@dataclass(frozen=True)
class RecentRejection:
    """One rejection as the controller keeps it for the operator (`AdmissionController.recent_rejections`).

    `at`: Unix seconds; `reason`, `message`, `retry_after` and `arithmetic` as the `AdmissionRejected`
    the client was given; `request_id` the submitter's id for it when its payload has one. Never prompt text.
    """

    at: float
    reason: str
    message: str
    retry_after: int | None
    arithmetic: dict[str, Any]
    request_id: str | None

    @property
    def line(self) -> str:
        """The arithmetic as its log line writes it (`arithmetic_line`)."""
        return arithmetic_line(self.arithmetic)


class AdmissionIntegrityError(RuntimeError):
    """The controller's bookkeeping broke one of its invariants (a bug, never a user error)."""


def unservable_message(
    prompt: int, max_tokens: int, blocks: int, block_size: int, num_blocks: int, max_model_len: int
) -> str:
    """Why a request can never run on this node."""
    if prompt >= max_model_len:
        return (
            f"prompt of {prompt} tokens leaves no room for output: the maximum context length is {max_model_len} tokens"
        )
    if prompt + max_tokens > max_model_len:
        return (
            f"prompt of {prompt} tokens + max_tokens {max_tokens} = {prompt + max_tokens} tokens exceeds the "
            f"maximum context length of {max_model_len} tokens"
        )
    return (
        f"prompt of {prompt} tokens + max_tokens {max_tokens} needs {blocks} KV blocks of {block_size} tokens, "
        f"more than this node's whole pool of {num_blocks} blocks"
    )


def queue_full_message(depth: int, max_depth: int, running: int, wait: float, reload_left: float | None) -> str:
    """Why the queue takes no more: full, or full while the model reloads after a device fault."""
    if reload_left is not None:
        return (
            f"the model is reloading after a device fault and the admission queue is full ({depth} of "
            f"{max_depth} waiting); estimated {reload_left:.0f} s until it serves again"
        )
    return (
        f"the admission queue is full ({depth} of {max_depth} waiting, {running} running); the requests "
        f"waiting now are estimated to have started in {wait:.0f} s"
    )


def too_long_message(blocks: int, wait: float, max_wait: float, available: int, total: int, depth: int) -> str:
    """Why a request is refused at arrival: its estimated wait already exceeds the limit."""
    return (
        f"the {blocks} KV blocks this request needs are estimated to be free in {wait:.0f} s, beyond the "
        f"{max_wait:g} s wait limit ({available} of {total} blocks available now, {depth} requests queued)"
    )


def expired_message(waited: float, blocks: int, available: int, total: int, left: float) -> str:
    """Why a queued request gave up: it waited the limit."""
    return (
        f"waited {waited:.0f} s (the limit) for {blocks} KV blocks without admission ({available} of {total} "
        f"available); estimated {left:.0f} s more"
    )
