"""The engine's live rates: attribution of mixed steps, convergence, and robustness to bursts of slow steps."""

import math
import random
import statistics

import pytest

from helexa.admission import RateTracker
from helexa.admission.rates import RecentMedian


def test_first_samples_replace_the_priors_and_average_converges():
    rates = RateTracker()
    rates.observe_step(0.020, num_decode_tokens=8, num_prefill_tokens=0)
    assert rates.decode_step_seconds == pytest.approx(0.020)
    for _ in range(60):
        rates.observe_step(0.030, num_decode_tokens=8, num_prefill_tokens=0)
    assert rates.decode_step_seconds == pytest.approx(0.030, rel=1e-3)
    assert rates.rates().decode_step_seconds == pytest.approx(rates.decode_step_seconds)


def test_a_burst_of_slow_steps_does_not_move_the_estimate_but_a_lasting_change_does():
    rates = RateTracker(window=64)
    for _ in range(40):
        rates.observe_step(0.010, num_decode_tokens=4, num_prefill_tokens=0)
    for _ in range(20):  # a storm of arrivals starves the loop for 20 steps
        rates.observe_step(0.250, num_decode_tokens=4, num_prefill_tokens=0)
    assert rates.decode_step_seconds == pytest.approx(0.010)
    for _ in range(20):  # it lasts: now most of the window is slow
        rates.observe_step(0.250, num_decode_tokens=4, num_prefill_tokens=0)
    assert rates.decode_step_seconds == pytest.approx(0.250)


def test_mixed_step_is_split_by_the_current_shares():
    rates = RateTracker()
    rates.observe_step(0.010, num_decode_tokens=4, num_prefill_tokens=0)
    rates.observe_step(0.100, num_decode_tokens=0, num_prefill_tokens=100)  # 1 ms per prompt token
    before = (rates.decode_step_seconds, rates.prefill_token_seconds)
    rates.observe_step(0.110, num_decode_tokens=4, num_prefill_tokens=100)  # exactly the sum of both
    assert (rates.decode_step_seconds, rates.prefill_token_seconds) == pytest.approx(before)


def test_a_storm_of_slow_steps_longer_than_a_count_window_does_not_own_the_median():
    """What a full-suite run saw: a burst of arrivals slowed a second or two of steps several times over, more
    steps than half of the last 64, and a wait estimate made during it jumped 9x at the same queue depth. Over
    a span of work the many fast steps before the storm outnumber its few slow ones; a lasting change still wins."""
    rates = RateTracker()
    for _ in range(1000):  # 2 s of work at 2 ms a step
        rates.observe_step(0.002, num_decode_tokens=8, num_prefill_tokens=0)
    for _ in range(100):  # a 2 s storm: 100 steps of 20 ms
        rates.observe_step(0.020, num_decode_tokens=8, num_prefill_tokens=0)
    assert rates.decode_step_seconds == pytest.approx(0.002)
    for _ in range(500):  # it lasts: 10 s of work at 20 ms a step
        rates.observe_step(0.020, num_decode_tokens=8, num_prefill_tokens=0)
    assert rates.decode_step_seconds == pytest.approx(0.020)
    for _ in range(1000):  # and back: 2 s at 2 ms outnumber 10 s of 20 ms steps within the horizon
        rates.observe_step(0.002, num_decode_tokens=8, num_prefill_tokens=0)
    assert rates.decode_step_seconds == pytest.approx(0.002)


def test_prompt_token_costs_follow_the_same_horizon():
    rates = RateTracker()
    for _ in range(200):  # 200 prefills of 100 tokens at 10 us a token: 0.2 s of work
        rates.observe_step(0.001, num_decode_tokens=0, num_prefill_tokens=100)
    for _ in range(50):  # a storm: 50 of them 20x slower (1 s)
        rates.observe_step(0.020, num_decode_tokens=0, num_prefill_tokens=100)
    assert rates.prefill_token_seconds == pytest.approx(1e-5)


@pytest.mark.parametrize("seconds", [math.nan, math.inf, -math.inf, 0.0, -0.01])
def test_a_step_time_that_is_not_a_finite_positive_number_is_ignored(seconds: float):
    rates = RateTracker()
    rates.observe_step(0.010, num_decode_tokens=4, num_prefill_tokens=100)
    before = (rates.decode_step_seconds, rates.prefill_token_seconds)
    rates.observe_step(seconds, num_decode_tokens=4, num_prefill_tokens=100)
    assert (rates.decode_step_seconds, rates.prefill_token_seconds) == before


def _kept(samples: list[tuple[float, float]], horizon: float, least: int, most: int) -> list[float]:
    """The reference: the newest samples, oldest dropped while the rest span `horizon` (the newest `least` stay)."""
    kept, ns = list(samples), lambda seconds: round(seconds * 1e9)  # work is counted in whole nanoseconds
    while len(kept) > most or (len(kept) > least and sum(ns(w) for _, w in kept[1:]) >= ns(horizon)):
        kept.pop(0)
    return [v for v, _ in kept]


@pytest.mark.parametrize("seed", range(6))
def test_recent_median_is_the_median_of_the_samples_the_rule_keeps(seed: int):
    rng = random.Random(seed)
    horizon, least, most = rng.choice([0.0, 0.05, 1.0]), rng.randint(1, 8), rng.randint(8, 40)
    median = RecentMedian(horizon, least, most)
    samples: list[tuple[float, float]] = []
    for _ in range(300):
        value = rng.choice([rng.random(), round(rng.random(), 1)])  # repeated values too
        work = rng.choice([0.0, rng.random() * 0.02, rng.random() * 0.5])
        median.add(value, work)
        samples.append((value, work))
        kept = _kept(samples, horizon, least, most)
        assert len(median) == len(kept)
        assert median.median() == pytest.approx(statistics.median(kept), abs=1e-12)


def test_recent_median_bounds_and_arguments():
    median = RecentMedian(10.0, 4, 16)
    assert median.median() is None
    for i in range(100):  # no work at all: only the bound on the count drops samples
        median.add(float(i), 0.0)
    assert len(median) == 16 and median.median() == pytest.approx(91.5)
    with pytest.raises(ValueError, match="min_samples"):
        RecentMedian(1.0, 0, 4)
    with pytest.raises(ValueError, match="min_samples"):
        RecentMedian(1.0, 8, 4)
    with pytest.raises(ValueError, match="horizon_seconds"):
        RecentMedian(math.nan, 1, 4)
