"""The wait estimator on constructed states, with exact expected numbers."""

from __future__ import annotations

import random

import pytest

from helexa.admission import EngineRates, FifoPlan, retry_after_seconds
from tests.support.admission import SeqWork, estimate_starts


def test_rates_priors_and_validation() -> None:
    r = EngineRates()
    assert r.decode_step_seconds == 0.05 and r.prefill_token_seconds == 0.0005
    assert EngineRates(0.25, 0.5).run_seconds(prefill_tokens=6, decode_tokens=8) == 5.0
    with pytest.raises(ValueError, match="decode_step_seconds"):
        EngineRates(decode_step_seconds=0.0)
    with pytest.raises(ValueError, match="prefill_token_seconds"):
        EngineRates(prefill_token_seconds=-1.0)
    with pytest.raises(ValueError):
        EngineRates(decode_step_seconds=float("inf"))


def test_blocks_gate_fifo_starts() -> None:
    # 10 blocks, 3 slots. Running: A holds 4 blocks with 2 prompt tokens + 3 output tokens left
    # (0.5 * 2 + 1 * 3 = 4 s), B holds 5 blocks with 10 output tokens left (10 s). 1 block free.
    rates = EngineRates(decode_step_seconds=1.0, prefill_token_seconds=0.5)
    running = [SeqWork(4, 2, 3), SeqWork(5, 0, 10)]
    waiting = [
        SeqWork(3, 0, 2),  # needs A's release (t=104), runs 2 s -> frees 3 blocks at 106
        SeqWork(6, 4, 1),  # 2 free at 104 + 3 at 106 = 5 < 6 -> waits for B at 110; runs 3 s
        SeqWork(1, 0, 1),  # fits at once at 110, but never starts before the one ahead of it
    ]
    starts = estimate_starts(100.0, rates, blocks_available=1, slots_available=1, running=running, waiting=waiting)
    assert starts == [104.0, 110.0, 110.0]


def test_slot_gate() -> None:
    # Plenty of blocks, no free slot: each waiter takes the next slot to come free.
    rates = EngineRates(decode_step_seconds=1.0, prefill_token_seconds=0.0)
    running = [SeqWork(1, 0, 5), SeqWork(1, 0, 2)]
    starts = estimate_starts(0.0, rates, 8, 0, running, [SeqWork(1, 0, 1), SeqWork(1, 0, 1), SeqWork(1, 0, 4)])
    # slot of the 2 s sequence -> W1 at 2 (ends 3) -> W2 at 3 (ends 4) -> W3 at 4
    assert starts == [2.0, 3.0, 4.0]


def test_nothing_running_starts_now() -> None:
    starts = estimate_starts(7.5, EngineRates(), 10, 2, [], [SeqWork(4, 0, 1), SeqWork(6, 0, 1)])
    assert starts == [7.5, 7.5]


def test_never_fits_raises() -> None:
    with pytest.raises(ValueError, match="can never start"):
        estimate_starts(0.0, EngineRates(), 2, 1, [SeqWork(3, 0, 1)], [SeqWork(6, 0, 1)])


def test_start_of_leaves_plan_unchanged_and_append_if_starts_by() -> None:
    rates = EngineRates(1.0, 0.0)
    plan = FifoPlan(0.0, 0, 4, [(5.0, 3, 0.0), (9.0, 4, 0.0), (2.0, 1, 0.0)])
    assert plan.start_of(4) == 5.0  # 1 back at 2 + 3 back at 5
    assert plan.start_of(1) == 2.0
    assert plan.start_of(4) == 5.0  # peeking twice gives the same answer
    assert plan.append_if_starts_by(4, 3.0, latest_start=4.0) == (5.0, False)
    assert plan.append_if_starts_by(3, 3.0, latest_start=8.0) == (5.0, True)  # holds 3 blocks until 8
    assert plan.time == 5.0
    assert plan.append(2, rates.run_seconds(0, 1)) == 8.0  # 1 left + 3 back at 8; holds 2 until 9
    assert plan.start_of(4) == 9.0  # 2 left + 2 back at 9 (the 4 from the first release also at 9)


def test_incremental_plan_equals_batch_simulation() -> None:
    rng = random.Random(1234)
    rates = EngineRates(decode_step_seconds=0.03, prefill_token_seconds=0.001)
    for _ in range(50):
        total, slots = rng.randint(8, 64), rng.randint(1, 6)
        running, used = [], 0
        for _ in range(rng.randint(0, slots)):
            b = rng.randint(1, max(1, total // 4))
            if used + b <= total:
                running.append(SeqWork(b, rng.randint(0, 50), rng.randint(0, 200)))
                used += b
        waiting = [SeqWork(rng.randint(1, total), rng.randint(1, 60), rng.randint(1, 100)) for _ in range(20)]
        batch = estimate_starts(3.0, rates, total - used, slots - len(running), running, waiting)
        plan = FifoPlan(
            3.0,
            total - used,
            slots - len(running),
            [(3.0 + rates.run_seconds(w.prefill_tokens, w.decode_tokens), w.blocks, w.decode_tokens) for w in running],
        )
        incremental = []
        for w in waiting:
            peek = plan.start_of(w.blocks)
            incremental.append(plan.append(w.blocks, rates.run_seconds(w.prefill_tokens, w.decode_tokens)))
            assert peek == incremental[-1]
        assert incremental == batch
        assert batch == sorted(batch)  # FIFO: nobody starts before the one ahead


def test_retry_after_rounds_up_at_least_one() -> None:
    assert retry_after_seconds(0.0) == 1
    assert retry_after_seconds(0.2) == 1
    assert retry_after_seconds(10.0) == 10
    assert retry_after_seconds(10.01) == 11
    assert retry_after_seconds(30.000000000001) == 30  # float noise does not add a second
