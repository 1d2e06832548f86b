"""Per-request token streams: the engine thread produces, a thread or an asyncio task consumes."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field


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
        self._pending: dict[asyncio.AbstractEventLoop, set[asyncio.Event]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, ready: asyncio.Event) -> None:
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


def _set_all(ready: set[asyncio.Event]) -> None:
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
    _async_ready: asyncio.Event | None = field(default=None, repr=False)
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
        """The next event, awaiting it on the caller's event loop without blocking the loop."""
        with self._cond:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
                self._async_ready = asyncio.Event()
        assert self._async_ready is not None
        while True:
            with self._cond:
                if self._events:
                    return self._events.popleft()
                self._async_ready.clear()
            await self._async_ready.wait()

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while True:
            event = await self.aget()
            yield event
            if event.finished:
                return
