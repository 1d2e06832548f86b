"""ASGI middleware, outermost first: request ids and the last-resort 500 (`RequestContextMiddleware`),
Bearer auth on `/v1/*` (`AuthMiddleware`), the request-body limit (`BodyLimitMiddleware`, 413)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from helexa.server.errors import APIError, error_response

logger = logging.getLogger("helexa.server")

# a body this large is joined and parsed on a worker thread, never on the event loop: megabytes of copying and
# JSON held every other connection's answer (`/health`, every stream's next chunk) for tens of ms on a busy CPU
LARGE_BODY_BYTES = 1 << 20
_DRAIN_LIMIT_BYTES = 64 << 20  # an oversized body is read and dropped up to this much, so the client sees the 413
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_of(scope: Scope) -> str:
    """The request id `RequestContextMiddleware` gave this request ("-" outside it)."""
    return scope.get("state", {}).get("request_id", "-")


def mark_client_gone(scope: Scope) -> None:
    """Record that the client left before the whole answer: the request counts as 499, whatever was sent."""
    scope.setdefault("state", {})["client_gone"] = True


class RequestContextMiddleware:
    """Gives each HTTP request an id (the client's `x-request-id` when well-formed, else a new one).

    Guarantees: every response carries `x-request-id`; an exception escaping the app is logged with the
    id and, when no response started yet, answered `500 internal_error` (its message names only the id);
    for `generation_paths`, `metrics.count_request(status)` and `metrics.observe_duration` run once each,
    with status 499 when the client left before the whole answer (`mark_client_gone`), as nginx logs it.
    """

    def __init__(self, app: ASGIApp, metrics: Any, generation_paths: frozenset[str]) -> None:
        self.app, self.metrics, self.generation_paths = app, metrics, generation_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        request_id = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.monotonic()
        status: int | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("request %s: %s %s failed", request_id, scope.get("method"), scope.get("path"))
            if status is None:
                error = APIError("internal_error", f"internal server error (request id {request_id})")
                await error_response(error)(scope, receive, send_with_id)
        finally:
            if scope["state"].get("client_gone"):
                status = 499
            if scope.get("path") in self.generation_paths and status is not None:
                self.metrics.count_request(status)
                self.metrics.observe_duration(time.monotonic() - started)


class AuthMiddleware:
    """With an API key, `/v1/*`, `/tokenize`, `/detokenize` and `/flush_cache` need `Authorization: Bearer <key>`
    (compared in constant time), else 401; `/health`, `/metrics` and the routers' load and info probes stay
    open, and everything is open without a key. The admin key (`--admin-api-key`), when given, is accepted
    wherever the API key is."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None = None) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None
        self._admin = admin_api_key.encode() if admin_api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        guarded = path.startswith("/v1/") or path in ("/tokenize", "/detokenize", "/flush_cache")
        if self._key is None or scope["type"] != "http" or not guarded:
            await self.app(scope, receive, send)
            return
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        sent = token.strip().encode()
        admin = self._admin is not None and hmac.compare_digest(sent, self._admin)
        if scheme.lower() == "bearer" and (hmac.compare_digest(sent, self._key) or admin):
            await self.app(scope, receive, send)
            return
        message = "missing API key: send 'Authorization: Bearer <key>'" if not token else "incorrect API key"
        await error_response(APIError("invalid_api_key", message), {"www-authenticate": "Bearer"})(scope, receive, send)


class BodyLimitMiddleware:
    """Reads a request body of at most `max_bytes`, then replays it to the app; 413 `request_too_large` beyond.

    A too-large body (by `Content-Length`, or counted while it streams in) is read and dropped (up to
    64 MiB) before the 413 is sent, so a client still uploading sees the answer instead of a reset. A
    body that stalls `timeout_secs` between two reads gets 408 `request_timeout`.
    After the body, `receive` passes through, so the app still sees `http.disconnect`.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_secs: float = 30.0) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app, self.max_bytes, self.timeout_secs = app, max_bytes, timeout_secs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        too_large = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        chunks: list[bytes] = []
        size, more, last = 0, True, None
        while more:
            try:
                message = await asyncio.wait_for(receive(), self.timeout_secs)
            except TimeoutError:
                logger.info(
                    "request %s: body stalled for %.0f s after %d bytes; 408",
                    request_id_of(scope),
                    self.timeout_secs,
                    size,
                )
                error = APIError(
                    "request_timeout", f"the request body stalled for {self.timeout_secs:g} s after {size} bytes"
                )
                await error_response(error, {"connection": "close"})(scope, receive, send)
                return
            if message["type"] != "http.request":  # the client left while sending
                last = message
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            too_large = too_large or size > self.max_bytes
            if not too_large:
                chunks.append(chunk)
            elif size > _DRAIN_LIMIT_BYTES:
                break
        if last is not None and last["type"] == "http.disconnect":
            shown_of = f" of {declared}" if declared is not None else ""
            logger.info(
                "request %s: client disconnected while sending its body (%d%s bytes received); 499",
                request_id_of(scope),
                size,
                shown_of,
            )
            mark_client_gone(scope)
            return
        if too_large:
            shown = int(declared) if declared is not None and declared.isdigit() else size
            error = APIError(
                "request_too_large",
                f"request body of {shown} bytes exceeds the limit of {self.max_bytes} bytes (--max-body-size)",
            )
            await error_response(error, {"connection": "close"})(scope, receive, send)
            return
        joined = await run_in_threadpool(b"".join, chunks) if size >= LARGE_BODY_BYTES else b"".join(chunks)
        pending = [last or {"type": "http.request", "body": joined, "more_body": False}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)
