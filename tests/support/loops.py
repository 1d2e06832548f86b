"""An event loop on its own thread that counts the wake-ups other threads send it."""

from __future__ import annotations

import asyncio
import threading

from helexa.engine.stream import RequestStream


class CountingLoop:
    """Runs an event loop on its own thread and counts the `call_soon_threadsafe` calls made to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.calls = 0
        inner = self.loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)

        self.loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def bind(self, stream: RequestStream) -> None:
        """Make this loop `stream`'s consumer (its first `aget` binds it) without taking an event: the stream
        must have none yet."""

        async def first() -> bool:
            try:
                await asyncio.wait_for(stream.aget(), 0.01)
            except TimeoutError:
                return True
            return False

        assert asyncio.run_coroutine_threadsafe(first(), self.loop).result(5), "the stream already had an event"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()
