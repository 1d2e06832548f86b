"""AdmissionController: the incident helexa is built against, rejections, deadlines, FIFO, backfill, cancel."""

from __future__ import annotations

import logging
import random
import threading

import pytest

from helexa.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionIntegrityError,
    AdmissionRejected,
    Capacity,
    EngineRates,
    TicketState,
)
from helexa.engine.faults import ModelHealth
from helexa.server.errors import from_admission
from tests.support.admission import FakeClock, FakeEngine, FixedKV, controller

EXACT = EngineRates(decode_step_seconds=0.5, prefill_token_seconds=0.0)


def make(clock: FakeClock | None = None, rates: EngineRates = EXACT, **overrides):
    cfg = dict(
        block_size=16,
        num_blocks=100,
        max_model_len=4096,
        max_num_seqs=4,
        max_queue_depth=4,
        max_wait_secs=600.0,
        replan_interval_secs=0.0,
    )
    cfg.update(overrides)
    return controller(clock=clock or FakeClock(), rates=rates, debug=True, **cfg)


def http(e: AdmissionRejected) -> tuple[int, str, dict[str, str]]:
    """The status, code and headers the server answers a rejection with."""
    error = from_admission(e)
    return error.status, error.code, error.headers()


def test_incident_in_miniature_third_long_request_queues_then_runs(caplog: pytest.LogCaptureFixture) -> None:
    # Two long turns hold the whole pool (50 blocks each); a third arrives. It must wait, not 503.
    clock = FakeClock()
    c = controller(16, 100, 4096, max_num_seqs=4, replan_interval_secs=0.0, clock=clock, rates=EXACT, debug=True)
    engine = FakeEngine(c, clock, step_seconds=0.5)
    first, second = c.submit(600, 200), c.submit(600, 200)
    assert first.state is second.state is TicketState.GRANTED
    assert (first.blocks_reserved, c.blocks_available) == (50, 0)
    engine.step()
    clock.advance(0.25)
    with caplog.at_level(logging.INFO, logger="helexa.admission"):
        third = c.submit(600, 200)
        assert third.state is TicketState.QUEUED
        assert c.queue_depth == 1 and c.snapshot()["rejected"] == {
            "queue_full": 0,
            "kv_timeout": 0,
            "kv_unservable": 0,
            "model_reloading": 0,
        }
        # 199 tokens left for each holder at 0.5 s per step, seen 0.25 s after the last step
        assert third.est_wait_at_arrival == pytest.approx(99.5)
        while third.state is TicketState.QUEUED:
            engine.step()
            c.check_integrity()
    assert third.state is TicketState.GRANTED and third.granted_at == pytest.approx(100.25)
    assert third.waited_seconds == pytest.approx(99.5)  # exactly the estimate
    lines = [r.getMessage() for r in caplog.records if r.name == "helexa.admission" and r.levelno == logging.INFO]
    assert len(lines) == 1
    assert lines[0].startswith(
        f"admission: admitted ticket={third.id} prompt=600 max_tokens=200 shared_blocks=0 "
        "blocks_needed=50 blocks_available=0 blocks_reserved=100 blocks_total=100 in_flight=2"
    )
    assert "waited_s=99.5" in lines[0] and "est_wait_s=99.5" in lines[0] and "deadline_s=600.0" in lines[0]
    engine.run_until_idle()
    assert third.state is TicketState.RELEASED and third.tokens_generated == 200
    assert (c.blocks_reserved, c.in_flight, c.queue_depth) == (0, 0, 0)
    assert c.snapshot()["blocks_free"] == 100
    snap = c.snapshot()
    assert (snap["admitted_total"], snap["admitted_after_wait"]) == (3, 1)
    assert snap["admission_wait_seconds_sum"] == pytest.approx(99.5) and sum(snap["rejected"].values()) == 0


def test_unservable_rejected_at_once_without_touching_the_queue(caplog: pytest.LogCaptureFixture) -> None:
    c = make(max_queue_depth=1)
    c.submit(1000, 600)  # 100 blocks: the whole pool
    queued = c.submit(100, 10)
    assert c.queue_depth == 1  # the queue is full too: unservable must still say "unservable"
    cases = [
        (1500, 200, "needs 107 KV blocks"),  # 1700 tokens = 107 blocks > 100
        (4000, 200, "exceeds the maximum context length of 4096"),
        (4096, None, "leaves no room for output"),
    ]
    with caplog.at_level(logging.WARNING, logger="helexa.admission"):
        for prompt, max_tokens, text in cases:
            with pytest.raises(AdmissionRejected) as info:  # raised by the call itself: never queued
                c.submit(prompt, max_tokens)
            e = info.value
            assert (e.reason, *http(e)[:2], e.retry_after, e.permanent) == (
                "kv_unservable",
                400,
                "context_length_exceeded",
                None,
                True,
            )
            assert text in e.message and http(e)[2] == {}
            assert from_admission(e).body()["error"]["code"] == "context_length_exceeded"
    assert c.queue_depth == 1 and list(c._queue.values()) == [queued]
    assert c.snapshot()["rejected"] == {"queue_full": 0, "kv_timeout": 0, "kv_unservable": 3, "model_reloading": 0}
    line = caplog.records[0].getMessage()
    assert line.startswith(
        "admission: rejected kv_unservable prompt=1500 max_tokens=200 shared_blocks=0 "
        "blocks_needed=107 blocks_available=0 blocks_reserved=100 blocks_total=100"
    )
    assert caplog.records[0].levelno == logging.WARNING and "max_model_len=4096" in line


def test_shared_blocks_reduce_the_reservation() -> None:
    kv = FixedKV(16, 100)
    c = make(kv=kv)
    # 1500 tokens = 94 blocks; 10 of the prompt's blocks held by running sequences -> 84 reserved
    t = c.submit(1300, 200, request_id=kv.request(1300, shared=10))
    assert (t.blocks_reserved, kv.shared_blocks(t.request_id)) == (84, 10)
    assert t.prompt_prefilled == 160 and t.state is TicketState.GRANTED and kv.pinned == {t.request_id: 10}
    # a 32-token prompt fills 2 blocks, but its last token is always computed: only the first is shared
    u = c.submit(32, 5, request_id=kv.request(32, shared=3))
    assert (kv.shared_blocks(u.request_id), u.blocks_reserved) == (1, 2)
    # a request that does not fit pins nothing; measured again (and pinned) when it is granted
    v = c.submit(1300, 200, request_id=kv.request(1300, shared=10))
    assert v.state is TicketState.QUEUED and v.blocks_reserved == 84 and v.request_id not in kv.pinned
    c.release(t)
    assert kv.released == [t.request_id] and v.state is TicketState.GRANTED and kv.pinned[v.request_id] == 10
    c.check_integrity()


def test_blocks_a_tier_will_load_are_reserved_and_priced_at_the_load_rate() -> None:
    """A prompt whose blocks after the hit are in a tier below the pool: they are charged like computed ones (its
    reservation is unchanged), but every wait estimate prices them at the measured load cost, not the compute
    cost; before a load was measured, as computed."""
    for load, expected_wait in ((0.001, 500 * 0.01 + 800 * 0.001 + 20 * 0.5), (None, 1300 * 0.01 + 20 * 0.5)):
        kv = FixedKV(16, 100)
        rates = EngineRates(decode_step_seconds=0.5, prefill_token_seconds=0.01, load_token_seconds=load)
        c = make(kv=kv, rates=rates)
        a = c.submit(1300, 20, stops_early=False, request_id=kv.request(1300, tier=50))  # 800 tokens on a tier
        assert a.state is TicketState.GRANTED and a.blocks_reserved == 83  # loaded blocks are its own: reserved
        assert (a.prompt_prefilled, a.prompt_loadable, a.prefill_tokens_left) == (0, 800, 500)
        b = c.submit(1300, 20, stops_early=False, request_id=kv.request(1300))  # waits for a's blocks
        assert b.state is TicketState.QUEUED and b.est_wait_at_arrival == pytest.approx(expected_wait)
        assert c.snapshot()["load_token_seconds"] == load
        # the engine loads, then reports: nothing more to load; the plan now waits only for a's decode
        c.progress(a, prompt_prefilled=800, prompt_loadable=0)
        assert a.prefill_tokens_left == 500
        with pytest.raises(ValueError, match="prompt_loadable=1301 exceeds"):
            c.progress(a, prompt_loadable=1301)
        c.check_integrity()


def test_a_head_that_cannot_fit_even_fully_shared_costs_no_lookup() -> None:
    kv = FixedKV(16, 100)
    c = make(kv=kv)
    a = c.submit(1300, 200, request_id=kv.request(1300))  # 94 blocks
    small = c.submit(40, 40, request_id=kv.request(40))  # 5 blocks: 1 available
    big = c.submit(800, 700, request_id=kv.request(800, shared=2))  # 94 blocks, at best 45 with its prefix shared
    assert big.state is TicketState.QUEUED and big.blocks_reserved == 92  # measured once, for the plan
    lookups = kv.lookups
    c.release(small)  # 6 available: far below its best case, so the queue's head is not looked up
    assert kv.lookups == lookups and big.state is TicketState.QUEUED
    c.release(a)  # 100 available: looked up, granted with its 2 shared blocks
    assert kv.lookups == lookups + 1 and big.state is TicketState.GRANTED and big.blocks_reserved == 92
    c.check_integrity()


def test_default_max_tokens() -> None:
    c = make(default_max_tokens=100, max_model_len=1000)
    assert c.submit(50).max_tokens == 100
    assert c.submit(950).max_tokens == 50  # capped by max_model_len - prompt
    assert c.submit(950).blocks_reserved == 63  # ceil(1000 / 16)


def test_bad_input_raises_value_error() -> None:
    c = make()
    for args, kwargs in [((0,), {}), ((True,), {}), ((10, 0), {}), ((10, 2.5), {}), ((10,), {"max_tokens": -1})]:
        with pytest.raises(ValueError):
            c.submit(*args, **kwargs)
    with pytest.raises(ValueError):
        Capacity(block_size=0, num_blocks=10, max_model_len=10)
    with pytest.raises(ValueError):
        AdmissionConfig(policy="lifo")
    with pytest.raises(ValueError):
        AdmissionConfig(max_wait_secs=0)


def test_queue_full_is_429_with_estimated_retry_after(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(50.0)
    c = make(clock, max_queue_depth=2)
    c.submit(600, 20), c.submit(600, 20)  # 2 x 40 blocks, 10 s of decode each
    c.submit(600, 60), c.submit(100, 10)  # 40 + 8 blocks: the head waits for one holder (10 s)
    clock.advance(3.0)
    with caplog.at_level(logging.WARNING, logger="helexa.admission"):
        with pytest.raises(AdmissionRejected) as info:
            c.submit(16, 4)
    e = info.value
    assert (e.reason, *http(e)[:2]) == ("queue_full", 429, "queue_full")
    assert e.retry_after == 7 and http(e)[2] == {"Retry-After": "7"}  # head starts at 60, now 53
    assert e.arithmetic["queue_depth"] == 2 and e.arithmetic["est_wait_s"] == 7.0
    assert "admission: rejected queue_full" in caplog.text and "queue_depth=2" in caplog.text
    assert c.queue_depth == 2 and c.snapshot()["rejected"]["queue_full"] == 1


def test_wait_beyond_deadline_is_503_at_once_with_the_estimate() -> None:
    c = make(max_wait_secs=15.0)
    c.submit(600, 20), c.submit(600, 20)  # 2 x 40 blocks until t=10
    c.submit(600, 20)  # 40 blocks: starts at 10 (ends 20)
    c.submit(600, 20)  # starts at 10 too (the second holder's blocks)
    with pytest.raises(AdmissionRejected) as info:
        c.submit(1200, 40)  # 78 blocks: needs both of those -> starts at 20 > 15
    e = info.value
    assert (e.reason, *http(e)[:2], e.retry_after) == ("kv_timeout", 503, "kv_timeout", 20)
    assert e.arithmetic["est_wait_s"] == 20.0 and e.arithmetic["deadline_s"] == 15.0
    assert "estimated to be free in 20 s" in e.message
    assert c.queue_depth == 2
    # a small one still fits before the deadline: it is queued with its estimate
    t = c.submit(16, 4)
    assert t.state is TicketState.QUEUED and t.est_wait_at_arrival == 10.0


def test_timeout_in_poll_rejects_with_the_remaining_estimate() -> None:
    clock = FakeClock()
    c = make(clock, max_wait_secs=15.0)
    holders = [c.submit(1000, 20), c.submit(16, 4)]
    queued = c.submit(600, 20)
    assert c.next_deadline() == 15.0 and queued.est_wait_at_arrival == 10.0
    c.poll()
    clock.advance(15.0)  # the engine ran slower than measured: 5 of 20 tokens in 15 s
    c.progress(holders[0], tokens_generated=5)
    res = c.poll()
    assert res.expired == [queued] and res.granted == []
    assert queued.state is TicketState.EXPIRED and c.queue_depth == 0 and c.next_deadline() is None
    e = queued.error
    assert (e.reason, *http(e)[:2]) == ("kv_timeout", 503, "kv_timeout")
    assert e.retry_after == 8  # 15 tokens left at 0.5 s -> the holder ends in 7.5 s
    assert c.snapshot()["rejected"]["kv_timeout"] == 1
    c.check_integrity()


def test_fifo_large_head_is_not_starved_by_a_stream_of_small_requests() -> None:
    clock = FakeClock()
    c = make(clock, max_queue_depth=1000, max_num_seqs=8)
    engine = FakeEngine(c, clock, step_seconds=0.5)
    rng = random.Random(7)
    for _ in range(4):
        c.submit(100 + rng.randint(0, 50), 40)  # ~10 blocks each, 20 s each
    engine.step()
    big = c.submit(1200, 80)  # 80 blocks: must wait for most of the small ones
    arrivals = [big]
    for _ in range(60):  # a small request every step
        clock.advance(0.0)
        arrivals.append(c.submit(100 + rng.randint(0, 50), 10 + rng.randint(0, 30)))
        engine.step()
    engine.run_until_idle()
    grant_order = sorted(arrivals, key=lambda t: (t.granted_at, t.id))
    assert grant_order == arrivals  # strict FIFO: nobody behind the head got ahead of it
    assert big.granted_at == pytest.approx(20.0)  # when the first small holders finished (40 steps)
    assert c.blocks_reserved == 0 and c.snapshot()["admitted_total"] == 65


def _backfill_run(policy: str) -> tuple[dict[str, float], AdmissionController]:
    clock = FakeClock()
    c = make(clock, policy=policy, max_queue_depth=10)
    engine = FakeEngine(c, clock, step_seconds=0.5)
    tickets = {"holder": c.submit(900, 60)}  # 60 blocks until t=30
    engine.step()
    tickets["head"] = c.submit(1200, 80)  # 80 blocks: starts when the holder ends (t=30)
    tickets["short"] = c.submit(300, 20)  # 20 blocks for 10 s: ends by 30 -> may backfill
    tickets["long"] = c.submit(300, 80)  # 24 blocks for 40 s: would delay the head -> must wait
    engine.run_until_idle()
    return {k: t.granted_at for k, t in tickets.items()}, c


def test_backfill_lets_a_short_request_by_but_never_delays_the_head() -> None:
    fifo, _ = _backfill_run("reserve")
    backfill, c = _backfill_run("backfill")
    assert fifo["head"] == backfill["head"] == pytest.approx(30.0)
    assert fifo["short"] >= 30.0 and backfill["short"] == pytest.approx(0.5)  # backfilled at once
    assert backfill["long"] >= backfill["head"]
    assert c.blocks_reserved == 0


def test_cancel_while_queued_and_while_granted() -> None:
    clock = FakeClock()
    wakes = []
    c = controller(
        16,
        100,
        4096,
        max_num_seqs=4,
        replan_interval_secs=0.0,
        clock=clock,
        rates=EXACT,
        wakeup=lambda: wakes.append(clock.t),
        debug=True,
    )
    running = c.submit(1000, 200)  # 75 blocks
    assert c.poll().granted == [running]
    a, b = c.submit(800, 100), c.submit(100, 10)  # 57 blocks (waits), 7 blocks (behind it)
    assert c.queue_depth == 2 and len(wakes) == 3
    # cancel the queued head: the one behind it fits at once
    assert c.cancel(a) is True and a.state is TicketState.CANCELLED
    assert b.state is TicketState.GRANTED and c.queue_depth == 0
    assert c.cancel(a) is False  # idempotent
    # b is granted but not yet polled: cancelling it returns its blocks at once
    assert c.cancel(b) is True and b.state is TicketState.CANCELLED and c.blocks_reserved == 75
    assert c.poll().granted == []
    # the running one: cancel requests an abort; blocks stay reserved until the engine releases
    c.progress(running, tokens_generated=12)
    assert c.cancel(running) is True and running.cancel_requested and c.cancel(running) is False
    assert running.state is TicketState.GRANTED and c.blocks_reserved == 75
    res = c.poll()
    assert res.cancelled == [running]
    assert c.release(running) is True and running.state is TicketState.CANCELLED
    assert c.release(running) is False
    assert (c.blocks_reserved, c.snapshot()["blocks_free"], c.in_flight) == (0, 100, 0)
    c.submit(1500, 10)  # 95 blocks
    waiting = c.submit(200, 10)
    with pytest.raises(ValueError, match="queued"):
        c.release(waiting)


def test_progress_all_records_a_step_at_once_or_nothing() -> None:
    """`progress_all` records what `progress` records for each ticket; one bad update (over its bounds, a
    negative or non-int value, another controller's ticket) raises and leaves every ticket as it was."""
    kv = FixedKV(16, 100)
    c = make(kv=kv)
    a, b = (c.submit(100, 10, request_id=kv.request(100)) for _ in range(2))
    c.progress_all([(a, 100, 3), (b, 40, 0)])
    assert (a.prompt_prefilled, a.tokens_generated, b.prompt_prefilled, b.tokens_generated) == (100, 3, 40, 0)
    stranger = make().submit(100, 10)
    for bad, match in (((b, 100, 11), "max_tokens"), ((b, 101, 1), "prompt"), ((b, -1, 1), "non-negative"),
                       ((b, 50, True), "int"), ((stranger, 1, 1), "does not belong")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            c.progress_all([(a, 100, 4), bad])
        assert (a.tokens_generated, b.prompt_prefilled, b.tokens_generated) == (3, 40, 0)
    c.progress_all([])  # an empty step records nothing
    c.check_integrity()


def test_progress_bounds_and_integrity() -> None:
    kv = FixedKV(16, 100)
    c = make(kv=kv)
    t = c.submit(100, 10, request_id=kv.request(100))  # 7 blocks
    with pytest.raises(ValueError, match="max_tokens"):
        c.progress(t, tokens_generated=11)
    with pytest.raises(ValueError, match="prompt"):
        c.progress(t, prompt_prefilled=101)
    kv.allocate(t.request_id, 7)
    c.progress(t, tokens_generated=10, prompt_prefilled=100)
    c.check_integrity()
    other = make()
    with pytest.raises(ValueError, match="does not belong"):
        other.release(t)
    kv.allocate(t.request_id, 9)  # the KV owner charges it more than admission reserved
    with pytest.raises(AdmissionIntegrityError, match="charged 9 blocks > its reservation 7"):
        c.check_integrity()


def test_model_reloading_rejection_uses_the_last_reload_duration() -> None:
    clock = FakeClock()
    health = ModelHealth(clock)
    c = make(clock, max_queue_depth=1, reload_status=health.reload_seconds_left)
    c.submit(1000, 200), c.submit(800, 10)  # one holds 75 blocks, one queued
    health.set("poisoned")
    clock.advance(4.0)
    health.set("reloading")
    with pytest.raises(AdmissionRejected) as info:
        c.submit(16, 4)
    assert (info.value.reason, *http(info.value)[:2]) == ("model_reloading", 503, "model_reloading")
    assert info.value.retry_after == 4  # no reload finished yet: as long again as so far
    clock.advance(6.0)
    health.set("loaded")  # that reload took 10 s
    health.set("reloading")
    clock.advance(3.0)
    with pytest.raises(AdmissionRejected) as info:
        c.submit(16, 4)
    assert info.value.retry_after == 7 and health.state == "reloading"
    assert c.snapshot()["rejected"]["model_reloading"] == 2
    with pytest.raises(ValueError):
        health.set("sleeping")


def test_snapshot_has_the_v1_admission_fields() -> None:
    kv = FixedKV(16, 100)
    c = controller(16, 100, 4096, max_num_seqs=3, max_queue_depth=5, rates=EXACT, kv=kv, debug=True)
    t = c.submit(100, 10, request_id=kv.request(100))
    kv.allocate(t.request_id, 7)
    s = c.snapshot()
    expected = {
        "block_size": 16,
        "blocks_total": 100,
        "blocks_free": 93,
        "blocks_reserved": 7,
        "blocks_available": 93,
        "blocks_cached": 0,
        "in_flight": 1,
        "max_in_flight": 3,
        "queue_depth": 0,
        "max_queue_depth": 5,
    }
    assert {k: s[k] for k in expected} == expected
    assert set(s["rejected"]) >= {"queue_full", "kv_timeout", "kv_unservable"}
    assert "model_state" not in s  # the engine adds it: the model's state lives there


def test_replan_interval_bounds_staleness_from_progress_only() -> None:
    clock = FakeClock()
    c = make(clock, replan_interval_secs=1.0)
    holder = c.submit(1000, 40)  # 75 blocks, 20 s
    c.poll()
    assert c.submit(800, 10).est_wait_at_arrival == 20.0
    clock.advance(0.5)
    c.progress(holder, tokens_generated=1)  # slower than the estimate: 39 left = 19.5 s from 0.5
    assert c.submit(16, 4).est_wait_at_arrival == 19.5  # plan of t=0 reused: 20 - 0.5
    clock.advance(0.5)
    c.progress(holder, tokens_generated=1)
    assert c.submit(16, 4).est_wait_at_arrival == 19.5  # replanned at t=1: 39 left -> ends at 20.5


def test_threads_submitting_and_cancelling() -> None:
    wake = threading.Event()
    c = controller(
        16,
        200,
        2048,
        max_num_seqs=8,
        max_queue_depth=64,
        rates=EngineRates(decode_step_seconds=0.001, prefill_token_seconds=0.0),
        wakeup=wake.set,
        debug=False,
    )
    stop = threading.Event()
    errors: list[BaseException] = []
    running: list = []

    def engine() -> None:
        try:
            while not stop.is_set() or c.in_flight or c.queue_depth:
                res = c.poll()
                running.extend(res.granted)
                for t in list(running):
                    if t.cancel_requested or t.tokens_generated + 1 >= t.max_tokens:
                        running.remove(t)
                        c.release(t)
                    else:
                        c.progress(t, tokens_generated=t.tokens_generated + 1)
                c.check_integrity()
                if not running:
                    wake.wait(0.005)
                    wake.clear()
        except BaseException as e:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(e)

    def client(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                try:
                    t = c.submit(rng.randint(1, 600), rng.randint(1, 60))
                except AdmissionRejected as e:
                    assert e.reason in ("queue_full", "kv_timeout", "kv_unservable")
                    continue
                if rng.random() < 0.4:
                    c.cancel(t)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=engine)] + [threading.Thread(target=client, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads[1:]:
        th.join(timeout=20)
    stop.set()
    threads[0].join(timeout=20)
    assert not any(th.is_alive() for th in threads) and errors == []
    c.check_integrity()
    assert (c.blocks_reserved, c.in_flight, c.queue_depth) == (0, 0, 0)
    assert c.snapshot()["blocks_free"] == 200
