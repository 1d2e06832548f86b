"""The engine's live rates: attribution of mixed steps, convergence, and robustness to bursts of slow steps."""

import pytest

from helexa.admission import RateTracker


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
