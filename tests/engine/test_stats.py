"""The engine's live rates: attribution of mixed steps, convergence, and robustness to a stalled step."""

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


def test_a_stalled_step_moves_the_average_a_bounded_amount():
    rates = RateTracker()
    for _ in range(10):
        rates.observe_step(0.010, num_decode_tokens=4, num_prefill_tokens=0)
    rates.observe_step(10.0, num_decode_tokens=4, num_prefill_tokens=0)  # a 1000x stall
    assert rates.decode_step_seconds <= 0.010 * (1 + rates.alpha * 3) + 1e-12


def test_mixed_step_is_split_by_the_current_shares():
    rates = RateTracker()
    rates.observe_step(0.010, num_decode_tokens=4, num_prefill_tokens=0)
    rates.observe_step(0.100, num_decode_tokens=0, num_prefill_tokens=100)  # 1 ms per prompt token
    before = (rates.decode_step_seconds, rates.prefill_token_seconds)
    rates.observe_step(0.110, num_decode_tokens=4, num_prefill_tokens=100)  # exactly the sum of both
    assert (rates.decode_step_seconds, rates.prefill_token_seconds) == pytest.approx(before)
