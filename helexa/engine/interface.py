"""What an engine hands the server, the same whether it runs in this process (`Engine`) or in its own
(`EngineClient`): its errors, the handle of a submitted request and its counters. Nothing here imports torch
or the model: the server's side of an engine core in its own process imports only this."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from helexa.engine.stream import RequestStream

if TYPE_CHECKING:
    from helexa.admission import Ticket
    from helexa.engine.sequence import Request

__all__ = ["DeviceFault", "EngineClosed", "EngineCounters", "EngineError", "RequestFailed", "RequestHandle"]


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class EngineError(RuntimeError):
    """A request failed because of the engine, not its input; the message carries the cause."""


class RequestFailed(EngineError):
    """One request failed because of its own parameters (its sampling raised); the others go on."""


class DeviceFault(EngineError):
    """The model could not be recovered after repeated device faults; the message carries the last cause."""


@dataclass(frozen=True)
class RequestHandle:
    """A submitted request: read its `stream` until the final event; `abort` it by `request_id`.

    `max_tokens` is the output limit admission granted (the request's, or the node's default);
    `request` is what was submitted.
    """

    request_id: str
    stream: RequestStream
    prompt_tokens: int
    max_tokens: int
    ticket: Ticket
    request: Request = field(repr=False)


@dataclass
class EngineCounters:
    """Totals since start, read by the server's metrics (monotonic, updated on the engine thread)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    model_seconds: float = 0.0
    device_faults: int = 0
    model_reloads: int = 0
    prefix_cache_query_tokens: int = 0  # prompt tokens looked up in the prefix cache (at each request's start)
    prefix_cache_hit_tokens: int = 0  # of those, found cached: their K/V was not computed
    prefix_cache_evictions: int = 0  # cached blocks evicted to make room (counted per step)
    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens whose K/V a preemption dropped, computed again on resume
