"""Request streams deliver in order across threads and to asyncio consumers, and close after the final event."""

import asyncio
import threading

from helexa.engine.stream import RequestStream, TokenEvent


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
    import time

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
