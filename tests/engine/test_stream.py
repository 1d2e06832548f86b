"""Request streams deliver in order across threads and to asyncio consumers, and close after the final event."""

import asyncio
import threading
import time

from helexa.engine.stream import RequestStream, TokenEvent, Wakeups
from tests.support.loops import CountingLoop


def _produce(stream: RequestStream, n: int) -> None:
    for i in range(n):
        stream.put(TokenEvent(token_ids=(i,), text=str(i)))
    stream.put(TokenEvent(finish_reason="stop"))
    stream.put(TokenEvent(token_ids=(999,)))  # after the final event: dropped


def test_sync_consumer_gets_every_event_in_order():
    stream = RequestStream("r1")
    producer = threading.Thread(target=_produce, args=(stream, 50))
    producer.start()
    events = list(stream)
    producer.join(timeout=5)
    assert [e.token_ids[0] for e in events[:-1]] == list(range(50))
    assert events[-1].finish_reason == "stop" and stream.closed


def test_async_consumer_is_woken_from_another_thread():
    async def consume() -> list[TokenEvent]:
        stream = RequestStream("r2")
        first = asyncio.ensure_future(stream.aget())
        await asyncio.sleep(0.01)  # the consumer is waiting before the producer starts
        producer = threading.Thread(target=_produce, args=(stream, 20))
        producer.start()
        events = [await asyncio.wait_for(first, 5)]
        async for event in stream:
            events.append(event)
        producer.join(timeout=5)
        return events

    events = asyncio.run(asyncio.wait_for(consume(), 10))
    assert [e.token_ids[0] for e in events[:-1]] == list(range(20))
    assert events[-1].finished


def test_get_times_out_when_nothing_arrives():
    assert RequestStream("r3").get(timeout=0.01) is None


def test_a_blocked_get_is_woken_by_the_next_put():
    """`put` wakes a consumer blocked in `get` at once (it skips the wake-up only when nobody waits)."""
    stream, got = RequestStream("r4"), []
    consumer = threading.Thread(target=lambda: got.append(stream.get(timeout=30)))
    consumer.start()
    deadline = time.monotonic() + 10
    while stream._waiting == 0 and time.monotonic() < deadline:  # the consumer is inside get's wait
        time.sleep(0.001)
    assert stream._waiting == 1
    start = time.monotonic()
    stream.put(TokenEvent(token_ids=(7,)))
    consumer.join(timeout=10)
    assert got and got[0].token_ids == (7,) and time.monotonic() - start < 5  # woken, not timed out
    assert stream._waiting == 0


def test_wakeups_wake_each_loop_once_for_a_batch_of_puts():
    """A batch of puts to many streams of one loop costs one `call_soon_threadsafe` (where each put alone costs
    one), and every consumer gets its events, in order, once the batch is woken."""
    counting = CountingLoop()
    try:
        streams = [RequestStream(f"w{i}") for i in range(8)]
        got: dict[str, list[int]] = {s.request_id: [] for s in streams}

        async def consume(stream: RequestStream) -> None:
            async for event in stream:
                if event.token_ids:
                    got[stream.request_id].append(event.token_ids[0])

        futures = [asyncio.run_coroutine_threadsafe(consume(s), counting.loop) for s in streams]
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), counting.loop).result(5)  # all are waiting
        counting.calls = 0
        wakeups = Wakeups()
        for i in range(3):  # three events to each stream, as a step with drafts emits
            for stream in streams:
                stream.put(TokenEvent(token_ids=(i,)), wakeups)
        assert counting.calls == 0  # owed, not yet woken
        wakeups.wake()
        assert counting.calls == 1
        wakeups.wake()  # nothing owed any more
        assert counting.calls == 1
        for stream in streams:
            stream.put(TokenEvent(finish_reason="stop"))  # alone: one wake-up each
        assert counting.calls == 1 + len(streams)
        for future in futures:
            future.result(5)
        assert got == {s.request_id: [0, 1, 2] for s in streams}
    finally:
        counting.close()


def test_wakeups_leave_a_blocked_get_and_a_closed_loop_alone():
    """A thread blocked in `get` is woken by the put itself; a consumer loop that has closed is skipped."""
    stream = RequestStream("w-sync")
    got: list[TokenEvent | None] = []
    consumer = threading.Thread(target=lambda: got.append(stream.get(timeout=30)))
    consumer.start()
    deadline = time.monotonic() + 10
    while stream._waiting == 0 and time.monotonic() < deadline:  # the consumer is inside get's wait
        time.sleep(0.001)
    stream.put(TokenEvent(token_ids=(5,)), Wakeups())  # never woken through the batch
    consumer.join(timeout=10)
    assert got and got[0] is not None and got[0].token_ids == (5,)

    counting = CountingLoop()
    bound = RequestStream("w-closed")
    counting.bind(bound)
    counting.close()
    wakeups = Wakeups()
    bound.put(TokenEvent(token_ids=(1,)), wakeups)
    wakeups.wake()  # the loop is closed: nothing raises
