"""Server-sent events: the framing, and an ASGI response that notices a client leaving mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"

# Characters that `str.splitlines` (and so line readers built on it, such as httpx's `iter_lines`) takes
# for line breaks but JSON leaves unescaped: escaped, a streamed token containing one cannot split an event.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)  # made once, not per event


def sse(data: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event: an optional `event:` line, then `data:` with compact JSON, then a blank line.

    The JSON holds no character any common line splitter breaks on (control characters are escaped by
    `json.dumps`; U+0085, U+2028 and U+2029 here), so each event is exactly its own lines. It is strict
    JSON: a non-finite float (which `json.dumps` would write as `-Infinity`) raises ValueError instead,
    as Starlette's `JSONResponse` does for a whole body.
    """
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {_json(data)}\n\n".encode()


def _json(value: Any) -> str:
    """`value` as the compact, strict JSON an event's data line holds, the three line breaks escaped."""
    payload = _ENCODER.encode(value)
    if "\x85" in payload or "\u2028" in payload or "\u2029" in payload:  # rare: three scans beat a translate
        payload = payload.translate(_LINE_BREAKS)
    return payload


_STAND_IN = "\ue000helexa: the text goes here\ue000"  # private-use characters: in no id, model name or text


class TextEvents:
    """Server-sent events that differ only in one string (a stream's text chunks, `text` -> `sse(data)`): the
    event is rendered once around a stand-in for the string and split there, and each event joins the two parts
    around the string's JSON. Guarantees: the same bytes `render(text)` gives, for any text, without encoding
    the whole object again."""

    __slots__ = ("_head", "_tail")

    def __init__(self, render: Callable[[str], bytes]) -> None:
        """`render(text)`: the whole event (made with `sse`) holding `text` once, as a JSON string."""
        rendered = render(_STAND_IN).decode()
        head, found, tail = rendered.partition(_json(_STAND_IN))
        if not found or _STAND_IN in tail:
            raise ValueError("the rendered event must hold the text exactly once")
        self._head, self._tail = head, tail

    def __call__(self, text: str) -> bytes:
        return f"{self._head}{_json(text)}{self._tail}".encode()


async def until_disconnected(receive: Receive) -> None:
    """Return when the ASGI `receive` channel reports `http.disconnect` (call after the body was read)."""
    while True:
        if (await receive())["type"] == "http.disconnect":
            return


async def race_disconnect(receive: Receive, work: asyncio.Future) -> bool:
    """Await `work` unless the client disconnects first; True if `work` finished first.

    On return (or cancellation) `work` is done: the loser is cancelled and awaited.
    """
    watch = asyncio.ensure_future(until_disconnected(receive))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    return work in done


class EventStreamResponse:
    """A `text/event-stream` response over `chunks`, aborted cleanly when the client disconnects.

    Guarantees: `chunks` is closed (its `finally` runs) however the response ends; `on_disconnect` is
    called exactly once if, and only if, the client left (or a send failed) before the last chunk was sent.
    """

    def __init__(
        self,
        chunks: AsyncGenerator[bytes, None],
        on_disconnect: Callable[[], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        self.chunks = chunks
        self.on_disconnect = on_disconnect
        self.headers = {
            "content-type": "text/event-stream; charset=utf-8",
            "cache-control": "no-cache",
            "x-accel-buffering": "no",
            **(headers or {}),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        try:
            sent = await race_disconnect(receive, pump) and pump.result()
        finally:
            await self.chunks.aclose()
        if not sent:
            self.on_disconnect()

    async def _pump(self, send: Send) -> bool:
        """Send every chunk; False when a send failed (the client is gone)."""
        raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        try:
            await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            return False
        return True
