"""Connections that never finish their request: a deadline for the request head, and a limit on connections.

`GuardedH11Protocol` is uvicorn's HTTP/1.1 protocol with a deadline for each request head (a client
that trickles its headers is closed). `ConnectionLimit` is the shared count of open connections;
`ConnectionLimitMiddleware` answers a fast 503 `overloaded` beyond it — except `/health` and
`/metrics`, which keep answering under a flood so the node never hides from its checks.
`quiet_accept_errors` rate-limits asyncio's log line for failed `accept()` calls (out of file
descriptors), which a flood would otherwise repeat thousands of times a second.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from helexa.server.errors import APIError, error_response

logger = logging.getLogger("helexa.server")

_OPEN = ("/health", "/metrics")


class ConnectionLimit:
    """How many connections are open now (read from the server once it runs) and how many are allowed."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self.connections: set[Any] = set()  # the server's own set of open connections, once attached

    @property
    def open(self) -> int:
        return len(self.connections)


class ConnectionLimitMiddleware:
    """Beyond `limit.max_connections` open connections, answer 503 `overloaded` at once (`Connection: close`);
    `/health` and `/metrics` are always served."""

    def __init__(self, app: Any, limit: ConnectionLimit) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        limit = self.limit
        if scope["type"] == "http" and scope.get("path") not in _OPEN and limit.open > limit.max_connections:
            error = APIError(
                "overloaded",
                f"the server has {limit.open} open connections, more than its limit of {limit.max_connections} "
                "(--max-connections); retry later",
            )
            await error_response(error, {"connection": "close"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


class GuardedH11Protocol(H11Protocol):
    """H11 with a deadline: the request head must arrive within `header_timeout` seconds of the connection
    (or of its previous response), else the connection is closed (one log line per 10 s at most)."""

    header_timeout = 10.0
    _last_log = 0.0
    _dropped = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()  # type: ignore[union-attr]
            self._head_timer = None

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request head arrived
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        cls = GuardedH11Protocol
        cls._dropped += 1
        now = time.monotonic()
        if now - cls._last_log >= 10.0:
            logger.warning(
                "closed %d connection(s) that sent no complete request head within %.0f s (slow or idle clients)",
                cls._dropped,
                self.header_timeout,
            )
            cls._last_log, cls._dropped = now, 0
        self.transport.close()


class _RateLimited(logging.Filter):
    """Lets one record per `interval` seconds through, with how many were dropped since."""

    def __init__(self, needle: str, interval: float = 10.0) -> None:
        super().__init__()
        self.needle, self.interval, self.last, self.dropped = needle, interval, -float("inf"), 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.needle not in record.getMessage():
            return True
        now = time.monotonic()
        if now - self.last < self.interval:
            self.dropped += 1
            return False
        if self.dropped:
            record.msg = f"{record.getMessage()} ({self.dropped} more like it in the last {self.interval:.0f} s)"
            record.args = ()
        self.last, self.dropped = now, 0
        return True


_ACCEPT_FILTER = _RateLimited("accept")


def quiet_accept_errors() -> None:
    """Rate-limit asyncio's failed-`accept()` log lines, and raise the open-file limit to its hard maximum."""
    log = logging.getLogger("asyncio")
    if _ACCEPT_FILTER not in log.filters:
        log.addFilter(_ACCEPT_FILTER)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
