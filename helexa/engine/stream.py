"""Per-request token streams: the engine thread produces; a thread, an asyncio task or a `StreamReader` (many
streams on one event loop) consumes."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of one token, with the top alternatives when they were asked for."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One step's output for one request.

    `token_ids` are the tokens sampled this step (one, or none for a final event that only
    carries a finish reason or an error); `text` is the newly completed text (may be empty while
    a multi-byte character or a possible stop string is held back). A final event has
    `finish_reason` set (`"stop"`, `"length"`, `"abort"` or `"error"`); an `"error"` event
    carries `error` (the exception the consumer should surface). `num_cached_tokens`: prompt tokens
    whose K/V came from the prefix cache instead of being computed.
    """

    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    error: BaseException | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def compact(self) -> tuple[tuple[int, ...], str, str | None, int, int, int] | None:
        """The event as a flat tuple of plain values, `(token_ids, text, finish_reason, num_prompt_tokens,
        num_output_tokens, num_cached_tokens)`, for a channel that carries many (the engine core's frames): a
        few times cheaper to make and read back than the event's dict of fields. None for an event with
        logprobs or an error, which crosses in full. `from_compact` gives the same event back."""
        if self.logprobs or self.error is not None:
            return None
        return (
            self.token_ids,
            self.text,
            self.finish_reason,
            self.num_prompt_tokens,
            self.num_output_tokens,
            self.num_cached_tokens,
        )

    @classmethod
    def from_compact(cls, row: tuple[tuple[int, ...], str, str | None, int, int, int]) -> TokenEvent:
        """The event `compact` gave `row` for (its values are taken as they are: the channel is private)."""
        token_ids, text, finish_reason, num_prompt, num_output, num_cached = row
        return cls(token_ids, text, (), finish_reason, None, num_prompt, num_output, num_cached)


class Ready(Protocol):
    """What an async consumer's loop is told when its stream has events: `set()`, called on that loop (an
    `asyncio.Event`, or a `StreamReader`'s mark)."""

    def set(self) -> None: ...


class Wakeups:
    """The consumer event loops one producer thread owes a wake-up, gathered over a batch of `put`s (a step's
    events, a frame's) and woken by `wake`: one `call_soon_threadsafe` per loop, however many streams and
    events the batch held, where each `put` alone would write to its loop's self-pipe once.

    Guarantees: after `wake` returns, every async consumer whose stream was put to since the last `wake` is
    woken (as `put` alone would have done it). Until then such a consumer may not notice the events, so a
    producer calls `wake` at the end of every batch, also when the batch fails (`try`/`finally`). Used by one
    thread at a time.
    """

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: dict[asyncio.AbstractEventLoop, set[Ready]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, ready: Ready) -> None:
        """Owe `loop` the setting of `ready`."""
        pending = self._pending.get(loop)
        if pending is None:
            self._pending[loop] = {ready}
        else:
            pending.add(ready)

    def wake(self) -> None:
        """Wake every loop owed a wake-up (once each) and forget them."""
        pending, self._pending = self._pending, {}
        for loop, ready in pending.items():
            try:
                loop.call_soon_threadsafe(_set_all, ready)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                pass


def _set_all(ready: set[Ready]) -> None:
    for event in ready:
        event.set()


@dataclass
class RequestStream:
    """A thread-safe, unbounded, single-consumer queue of `TokenEvent`s ending with a final event.

    Guarantees: events arrive in the order they were put; after the final event nothing more is
    delivered; `put` never blocks the producer (the engine thread) and, for an async consumer,
    wakes its event loop with `call_soon_threadsafe`.
    """

    request_id: str
    _events: deque = field(default_factory=deque, repr=False)
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    _async_ready: Ready | None = field(default=None, repr=False)
    _closed: bool = False
    _waiting: int = 0  # threads blocked in `get` (under `_cond`): `put` wakes only when there are any

    def put(self, event: TokenEvent, wakeups: Wakeups | None = None) -> None:
        """Deliver `event`; events after the final one are dropped. With `wakeups`, an async consumer's loop is
        not woken here but owed to `wakeups` (the caller's `wake` wakes it); a thread blocked in `get` is
        woken at once either way."""
        with self._cond:
            if self._closed:
                return
            self._events.append(event)
            if event.finished:
                self._closed = True
            if self._waiting:
                self._cond.notify_all()
            loop, ready = self._loop, self._async_ready
        if loop is not None and ready is not None:
            if wakeups is not None:
                wakeups.add(loop, ready)
                return
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                pass

    @property
    def closed(self) -> bool:
        """True once the final event has been put."""
        return self._closed

    @property
    def pending(self) -> int:
        """Events put and not yet taken (a reading, for a consumer deciding whether to wait)."""
        return len(self._events)

    def get(self, timeout: float | None = None) -> TokenEvent | None:
        """The next event, blocking up to `timeout` seconds; None on timeout."""
        with self._cond:
            if not self._events:
                self._waiting += 1
                try:
                    self._cond.wait(timeout)
                finally:
                    self._waiting -= 1
            return self._events.popleft() if self._events else None

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            event = self.get()
            if event is None:
                continue
            yield event
            if event.finished:
                return

    async def aget(self) -> TokenEvent:
        """The next event, awaiting it on the caller's event loop without blocking the loop. Raises
        `RuntimeError` for a stream a `StreamReader` reads."""
        with self._cond:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
                self._async_ready = asyncio.Event()
        ready = self._async_ready
        if not isinstance(ready, asyncio.Event):
            raise RuntimeError(f"stream {self.request_id!r} is read by a StreamReader, not awaited")
        while True:
            with self._cond:
                if self._events:
                    return self._events.popleft()
                ready.clear()
            await ready.wait()

    def listen(self, loop: asyncio.AbstractEventLoop, ready: Ready) -> bool:
        """Make the consumer `ready` on `loop`: each later `put` calls `ready.set()` there (a batch's puts once,
        through `Wakeups`). Returns True when events are already waiting (put before this call: nobody was
        told of them). Raises `RuntimeError` when the stream already has an async consumer."""
        with self._cond:
            if self._loop is not None:
                raise RuntimeError(f"stream {self.request_id!r} already has an async consumer")
            self._loop, self._async_ready = loop, ready
            return bool(self._events)

    def take(self) -> list[TokenEvent]:
        """Every event put and not yet taken, in order, at once (empty when none); never waits."""
        with self._cond:
            events = list(self._events)
            self._events.clear()
        return events

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while True:
            event = await self.aget()
            yield event
            if event.finished:
                return


class StreamReader:
    """Reads many requests' streams on one event loop with no task per stream: after a batch of puts (an engine
    step's, which wakes the loop once through `Wakeups`), `on_events` is called once, on the loop, with every
    stream that has new events and those events.

    Guarantees: each stream's events reach `on_events` in the order they were put, each exactly once, the
    final one last; a stream is forgotten after its final event. Events put before `add` are delivered too.
    `add` and `deliver` run on the loop's thread; `on_events` must not raise (what it raises propagates to
    the loop's exception handler, and the events it was given are not delivered again).
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_events: Callable[[list[tuple[RequestStream, list[TokenEvent]]]], None]
    ) -> None:
        self._loop, self._on_events = loop, on_events
        self._streams: dict[int, RequestStream] = {}  # by id (a stream compares by value)
        self._marked: dict[int, RequestStream] = {}  # streams with news, in the order they were marked
        self._scheduled = False

    @property
    def num_streams(self) -> int:
        """Streams added whose final event has not been delivered."""
        return len(self._streams)

    def add(self, stream: RequestStream) -> None:
        """Read `stream` from now on (raises `RuntimeError` when it already has an async consumer)."""
        waiting = stream.listen(self._loop, _Mark(self, id(stream)))
        self._streams[id(stream)] = stream
        if waiting:
            self.mark(stream)

    def mark(self, stream: RequestStream) -> None:
        """`stream` has events: deliver them (with every other marked stream's) in one call, soon."""
        self._marked[id(stream)] = stream
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.deliver)

    def deliver(self) -> None:
        """Hand every marked stream's events to `on_events` now (nothing when none has any)."""
        marked, self._marked, self._scheduled = self._marked, {}, False
        batch = []
        for key, stream in marked.items():
            events = stream.take()
            if events:
                batch.append((stream, events))
                if events[-1].finished:
                    self._streams.pop(key, None)
        if batch:
            self._on_events(batch)

    def deliver_all(self) -> None:
        """Hand every stream's waiting events to `on_events` now, marked or not (a last look before closing)."""
        self._marked.update(self._streams)
        self.deliver()


class _Mark:
    """A `StreamReader`'s `Ready` for one stream: setting it marks the stream (while the reader reads it). It
    names the stream by key, not by reference: the stream holds it, and no cycle outlives the stream."""

    __slots__ = ("_reader", "_key")

    def __init__(self, reader: StreamReader, key: int) -> None:
        self._reader, self._key = reader, key

    def set(self) -> None:
        stream = self._reader._streams.get(self._key)
        if stream is not None:
            self._reader.mark(stream)
