"""Request streams deliver in order across threads and to asyncio consumers, and close after the final event."""

import asyncio
import gc
import threading
import time
import weakref

import pytest

from helexa.engine.stream import RequestStream, StreamReader, TokenEvent, Wakeups
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


class _Batches:
    """`StreamReader`'s `on_events`, recording each call as {request id: token ids (-1 for a final event)}."""

    def __init__(self) -> None:
        self.calls: list[dict[str, list[int]]] = []

    def __call__(self, batch: list[tuple[RequestStream, list[TokenEvent]]]) -> None:
        ids = {s.request_id: [e.token_ids[0] if e.token_ids else -1 for e in events] for s, events in batch}
        self.calls.append(ids)


def _on_loop(counting: CountingLoop, fn, *args):
    """Run `fn(*args)` on the loop's thread and return its result (after every callback scheduled before)."""

    async def run():
        return fn(*args)

    return asyncio.run_coroutine_threadsafe(run(), counting.loop).result(5)


def _settle(counting: CountingLoop) -> None:
    """Until the loop has run what it was woken for, and the deliveries those callbacks scheduled."""
    for _ in range(3):
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), counting.loop).result(5)


def test_stream_reader_hands_a_batch_of_puts_over_in_one_call():
    """Many streams read on one loop: a batch of puts (three events each, as a step with drafts emits) costs
    one wake-up and reaches `on_events` in one call, each stream's events in order; a stream is forgotten
    after its final event, and what is put to it afterwards is dropped."""
    counting, batches = CountingLoop(), _Batches()
    try:
        reader = StreamReader(counting.loop, batches)
        streams = [RequestStream(f"s{i}") for i in range(6)]
        for stream in streams:
            _on_loop(counting, reader.add, stream)
        assert _on_loop(counting, lambda: reader.num_streams) == 6 and batches.calls == []
        counting.calls = 0
        wakeups = Wakeups()
        for i in range(3):
            for stream in streams:
                stream.put(TokenEvent(token_ids=(i,)), wakeups)
        wakeups.wake()
        assert counting.calls == 1
        _settle(counting)
        assert batches.calls == [{s.request_id: [0, 1, 2] for s in streams}]
        wakeups = Wakeups()
        for stream in streams[:2]:  # two end; the others have nothing this time and are not in the call
            stream.put(TokenEvent(token_ids=(3,)), wakeups)
            stream.put(TokenEvent(finish_reason="stop"), wakeups)
            stream.put(TokenEvent(token_ids=(4,)), wakeups)  # after the final event: dropped
        wakeups.wake()
        _settle(counting)
        assert batches.calls[1] == {"s0": [3, -1], "s1": [3, -1]}
        assert _on_loop(counting, lambda: reader.num_streams) == 4
    finally:
        counting.close()


def test_stream_reader_delivers_what_was_put_before_it_listened_and_what_nobody_woke():
    """Events put before `add` are delivered (nobody could be told of them); a put alone (no batch) wakes the
    loop itself; `deliver_all` takes events whose batch was never woken. A stream has one async consumer:
    a second, or awaiting a stream a reader reads, raises."""
    counting, batches = CountingLoop(), _Batches()
    try:
        reader = StreamReader(counting.loop, batches)
        early, late = RequestStream("early"), RequestStream("late")
        early.put(TokenEvent(token_ids=(1,)))
        _on_loop(counting, reader.add, early)
        _on_loop(counting, reader.add, late)
        _settle(counting)
        assert batches.calls == [{"early": [1]}]
        late.put(TokenEvent(token_ids=(2,)))  # no batch: its own wake-up
        _settle(counting)
        assert batches.calls[1] == {"late": [2]}
        early.put(TokenEvent(token_ids=(3,)), Wakeups())  # owed to a batch nobody wakes
        _settle(counting)
        assert len(batches.calls) == 2
        _on_loop(counting, reader.deliver_all)
        assert batches.calls[2] == {"early": [3]}
        with pytest.raises(RuntimeError, match="already has an async consumer"):
            _on_loop(counting, reader.add, early)

        async def awaited() -> TokenEvent:
            return await late.aget()

        with pytest.raises(RuntimeError, match="read by a StreamReader"):
            asyncio.run_coroutine_threadsafe(awaited(), counting.loop).result(5)
    finally:
        counting.close()


def test_a_stream_read_to_its_end_is_freed_without_the_collector():
    """A stream the reader has read to its final event is no longer held by the reader, and its consumer's mark
    makes no reference cycle with it: it is freed as its last reference goes, the cyclic collector off."""
    counting, batches = CountingLoop(), _Batches()
    gc.disable()
    try:
        reader = StreamReader(counting.loop, batches)
        stream = RequestStream("freed")
        _on_loop(counting, reader.add, stream)
        stream.put(TokenEvent(token_ids=(1,)))
        stream.put(TokenEvent(finish_reason="stop"))
        _settle(counting)
        assert batches.calls and _on_loop(counting, lambda: reader.num_streams) == 0
        ref = weakref.ref(stream)
        del stream
        assert ref() is None
    finally:
        gc.enable()
        counting.close()
