"""Admission that plans with what answers really do: expected waits, learned lengths, and the adaptive policy.

Exact block counts and times on a fake clock; `debug=True` checks every invariant after each change.
"""

from __future__ import annotations

import logging

import pytest

from helexa.admission import AdmissionRejected, EngineRates, TicketState
from helexa.admission.lengths import AnswerLengths
from tests.support.admission import FakeClock, FakeEngine, FixedKV, controller

EXACT = EngineRates(decode_step_seconds=1.0, prefill_token_seconds=0.0)


def _short_answers(tokens: int = 8, count: int = 30) -> AnswerLengths:
    """Lengths learned from `count` answers that all ended naturally after `tokens` tokens."""
    lengths = AnswerLengths()
    for _ in range(count):
        lengths.observe(tokens, "stop")
    return lengths


def _make(lengths: AnswerLengths | None = None, clock: FakeClock | None = None, **overrides):
    cfg = dict(
        block_size=16,
        num_blocks=100,
        max_model_len=4096,
        max_num_seqs=4,
        max_queue_depth=8,
        max_wait_secs=60.0,
        replan_interval_secs=0.0,
    )
    cfg.update(overrides)
    return controller(clock=clock or FakeClock(), rates=EXACT, lengths=lengths, debug=True, **cfg)


# --------------------------------------------------------------------------- expected, not worst-case, waits


def test_a_servable_request_is_queued_where_the_worst_case_bound_refused_it(caplog) -> None:
    """A holder may generate 1,000 tokens (1,000 s at 1 s a step); answers here end after 8.

    The worst-case planner refuses a second request needing the holder's blocks (wait 1,000 s > 60 s);
    the learned one expects the holder to finish in 8 s, queues it, and logs the basis of that estimate.
    """
    outcomes = {}
    for name, lengths in (("worst case", AnswerLengths(prior_mean=float("inf"))), ("learned", _short_answers())):
        c = _make(lengths)
        assert c.submit(10, 1000).blocks_reserved == 64  # ceil(1010 / 16); 36 blocks left
        with caplog.at_level(logging.DEBUG, logger="helexa.admission"):
            try:
                outcomes[name] = c.submit(10, 1000)
            except AdmissionRejected as exc:
                outcomes[name] = exc
        assert c.estimate_wait(10, 1000) == pytest.approx(1000.0 if name == "worst case" else 16.0)
        assert c.estimate_wait(10, 1000, worst_case=True) == pytest.approx(1000.0 if name == "worst case" else 2000.0)
    rejected, queued = outcomes["worst case"], outcomes["learned"]
    assert isinstance(rejected, AdmissionRejected) and rejected.reason == "kv_timeout"
    assert rejected.arithmetic["est_wait_s"] == 1000.0 and rejected.retry_after == 1000
    assert rejected.arithmetic["length_basis"] == "prior" and rejected.arithmetic["expected_output"] == 1000
    assert queued.state is TicketState.QUEUED
    assert queued.est_wait_at_arrival == pytest.approx(8.0)
    line = next(r.getMessage() for r in caplog.records if "queued ticket=2" in r.getMessage())
    assert "length_basis=observed length_samples=30 expected_output=8" in line
    assert "waits_on=1 waits_on_expected_tokens=8" in line


def test_a_running_request_is_expected_to_finish_given_what_it_has_generated() -> None:
    # answers end at 5 or at 40 tokens: one still going after 5 is a 40, with 35 - (g - 5) left
    lengths = AnswerLengths()
    for tokens in [5] * 20 + [40] * 20:
        lengths.observe(tokens, "stop")
    clock = FakeClock()
    c = _make(lengths, clock, num_blocks=6, max_num_seqs=1)
    engine = FakeEngine(c, clock, stop_early={1: 40})
    first = c.submit(16, 64)  # 5 blocks of 6
    engine.step()
    second = c.submit(16, 64)
    # one token in: E[min(L, 64) - 1 | L > 1] = (5 + 35 / 2) - 1 = 21.5 tokens at 1 s each
    assert second.est_wait_at_arrival == pytest.approx(21.5)
    for _ in range(9):
        engine.step()
    assert first.tokens_generated == 10  # still going after 5: it is one of the 40s, 30 tokens left
    assert c.submit(16, 64).state is TicketState.QUEUED  # (replans)
    assert second.est_start - clock.t == pytest.approx(30.0)


def test_requests_that_cannot_stop_early_are_estimated_exactly_and_teach_nothing() -> None:
    clock = FakeClock()
    c = _make(_short_answers(), clock, num_blocks=70, max_num_seqs=2, max_wait_secs=2000.0)
    engine = FakeEngine(c, clock, teach=True)
    bench = c.submit(10, 1000, stops_early=False)  # ignore_eos and no stop: it runs to 1,000
    queued = c.submit(10, 100)
    assert queued.state is TicketState.QUEUED
    assert queued.est_wait_at_arrival == pytest.approx(1000.0)
    engine.run_until_idle(max_steps=1200)
    assert bench.state is TicketState.RELEASED and c.lengths.samples == 31  # only the 100-token one was learned


def test_release_teaches_lengths_through_the_engine_outcome() -> None:
    clock = FakeClock()
    c = _make(AnswerLengths(min_samples=4), clock, num_blocks=400)
    engine = FakeEngine(c, clock, teach=True, stop_early={1: 3, 2: 3, 3: 3})
    for _ in range(4):
        c.submit(10, 20)
    engine.run_until_idle()
    assert c.lengths.samples == 4 and c.lengths.basis == "observed"
    # three natural ends at 3, one cut at 20: E[min(L, 20)] = 3/4 * 3 + 1/4 * 20
    assert c.lengths.expected_remaining(0, 20) == pytest.approx(0.75 * 3 + 0.25 * 20)
    snap = c.snapshot()
    assert snap["answer_length_basis"] == "observed" and snap["answer_length_samples"] == 4


# --------------------------------------------------------------------------- the adaptive policy


def test_adaptive_reserves_the_prompt_plus_a_learned_allowance() -> None:
    c = _make(_short_answers(8), policy="adaptive")
    t = c.submit(20, 1200)
    assert t.state is TicketState.GRANTED
    assert t.blocks_reserved == 2  # ceil((20 + 8) / 16), not ceil((20 + 1200) / 16) = 77
    assert c.submit(20, 1000, stops_early=False).blocks_reserved == 64  # it will run to its limit: the bound


def test_adaptive_can_never_fit_is_still_a_fast_permanent_rejection() -> None:
    c = _make(_short_answers(8), policy="adaptive")
    with pytest.raises(AdmissionRejected) as info:
        c.submit(20, 1700)  # ceil(1720 / 16) = 108 > 100 blocks, even though its allowance would fit
    assert info.value.reason == "kv_unservable" and info.value.permanent


def test_grow_takes_whole_blocks_until_the_pool_is_short() -> None:
    c = _make(_short_answers(8), policy="adaptive", num_blocks=10)
    a = c.submit(20, 120)
    b = c.submit(20, 120)
    c.poll()
    assert (a.blocks_reserved, b.blocks_reserved, c.blocks_available) == (2, 2, 6)
    assert c.grow(a, 2) and a.blocks_reserved == 2  # already covered
    assert c.grow(a, 7) and (a.blocks_reserved, c.blocks_available) == (7, 1)
    assert not c.grow(b, 4) and (b.blocks_reserved, c.blocks_available) == (2, 1)  # nothing changed
    with pytest.raises(ValueError, match="bound"):
        c.grow(a, 10)  # ceil(140 / 16) = 9 is all it can ever need


def test_under_reserve_a_reservation_is_already_its_bound() -> None:
    c = _make(_short_answers(8))
    t = c.submit(20, 200)
    c.poll()
    assert t.blocks_reserved == 14 and c.grow(t, 14)
    with pytest.raises(ValueError, match="bound of 14"):
        c.grow(t, 15)


def test_preempted_ticket_waits_ahead_of_the_queue_never_expires_and_resumes_first(caplog) -> None:
    clock = FakeClock()
    c = _make(_short_answers(8), clock, policy="adaptive", num_blocks=10, max_wait_secs=10.0)
    a, b = c.submit(20, 120), c.submit(20, 120)
    c.poll()
    c.progress(b, tokens_generated=4, prompt_prefilled=20)
    assert c.grow(a, 8)
    with caplog.at_level(logging.INFO, logger="helexa.admission"):
        c.preempt(b)  # the engine freed b's blocks to let a grow
    assert c.grow(a, 9)  # a takes one of them: 1 block left, too few for b to resume
    assert b.state is TicketState.QUEUED and b.preemptions == 1
    assert (b.prompt_prefilled, b.tokens_generated) == (0, 4)
    # resumes with prompt + its 4 tokens + the allowance given 4 generated (8): ceil(28 / 16) = 2
    assert b.blocks_reserved == 2
    snap = c.snapshot()
    assert (snap["preemptions"], snap["preempted_waiting"], snap["queue_depth"], snap["in_flight"]) == (1, 1, 1, 1)
    assert snap["blocks_reserved"] == 9
    line = next(r.getMessage() for r in caplog.records if "preempted" in r.getMessage())
    assert "ticket=2" in line and "generated=4 blocks_freed=2" in line
    # a newcomer that would fit waits behind the preempted ticket (the queue is FIFO behind resumes)
    late = c.submit(16, 16)
    assert late.state is TicketState.QUEUED
    clock.advance(11.0)  # past max_wait_secs: the newcomer expires, the preempted ticket never does
    polled = c.poll()
    assert polled.expired == [late] and polled.granted == [] and b.state is TicketState.QUEUED
    c.release(a, finish_reason="stop", output_tokens=120)
    assert c.poll().granted == [b] and b.state is TicketState.GRANTED and b.preemptions == 1
    assert c.snapshot()["admitted_total"] == 2  # a resume is not a second admission


def test_a_preempted_ticket_can_be_cancelled_and_returns_nothing_twice() -> None:
    c = _make(_short_answers(8), policy="adaptive", num_blocks=10)
    a, b = c.submit(20, 120), c.submit(20, 120)
    c.poll()
    c.preempt(b)
    assert c.cancel(b) and b.state is TicketState.CANCELLED
    assert c.snapshot()["queue_depth"] == 0 and c.blocks_reserved == a.blocks_reserved
    assert not c.release(b)
    c.release(a)
    assert c.blocks_reserved == 0


def test_preempt_only_running_tickets() -> None:
    c = _make(_short_answers(8), policy="adaptive", num_blocks=10)
    t = c.submit(20, 120)
    with pytest.raises(ValueError, match="engine runs"):
        c.preempt(t)  # granted but not yet picked up by the engine
    # under `reserve` a preempted ticket (a replay that no longer fits after a device fault) resumes
    # with its worst case reserved again, ahead of the queue
    reserve = _make(_short_answers(8), num_blocks=20)
    r = reserve.submit(20, 200)
    reserve.poll()
    q = reserve.submit(20, 200)
    assert q.state is TicketState.QUEUED
    reserve.preempt(r)
    assert r.state is TicketState.QUEUED and r.blocks_reserved == 14 and reserve.queue_depth == 2
    assert reserve.poll().granted == [r] and q.state is TicketState.QUEUED
    reserve.check_integrity()


def test_snapshot_blocks_add_up_from_one_pool_reading() -> None:
    kv = FixedKV(16, 100)
    c = controller(16, 100, 4096, kv=kv, rates=EXACT)
    t = c.submit(10, 100, request_id=kv.request(10))
    c.poll()
    kv.allocate(t.request_id, 3)  # the engine allocated 3 blocks: the KV owner's reading says so at once
    snap = c.snapshot()
    assert snap["blocks_free"] + snap["blocks_in_use"] + snap["blocks_cached"] == snap["blocks_total"]
    assert (snap["blocks_free"], snap["blocks_empty"], snap["blocks_in_use"]) == (97, 97, 3)
    c.release(t)


def test_a_regranted_ticket_released_before_the_engine_picks_it_up_is_never_handed_over() -> None:
    c = _make(_short_answers(8), policy="adaptive", num_blocks=10)
    a, b = c.submit(20, 120), c.submit(20, 120)
    c.poll()
    c.preempt(b)
    c.release(a)  # b is regranted at once, waiting for the engine's next poll
    assert b.state is TicketState.GRANTED
    assert c.release(b)  # (the engine ended it first: aborted while preempted)
    assert c.poll().granted == [] and c.blocks_reserved == 0 and c.in_flight == 0
