"""Learned answer lengths: the conditional expectation and allowance on constructed distributions, exact numbers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helexa.admission.lengths import AnswerLengths


def _taught(*groups: tuple[int, int, str], **kwargs) -> AnswerLengths:
    """An AnswerLengths that saw `count` answers of `tokens` tokens ending with `reason`, per group."""
    lengths = AnswerLengths(**kwargs)
    for count, tokens, reason in groups:
        for _ in range(count):
            lengths.observe(tokens, reason)
    return lengths


def test_prior_is_a_constant_rate_with_the_stated_mean_until_enough_answers() -> None:
    lengths = AnswerLengths(prior_mean=256.0, min_samples=20)
    q = 1.0 - 1.0 / 256.0
    assert lengths.basis == "prior" and lengths.samples == 0
    assert lengths.expected_remaining(0, 4096) == pytest.approx(256.0 * (1.0 - q**4096))
    assert lengths.expected_remaining(0, 10) == pytest.approx(256.0 * (1.0 - q**10))
    # memoryless: having generated 100 tokens changes nothing but the room left
    assert lengths.expected_remaining(100, 4096) == pytest.approx(lengths.expected_remaining(0, 3996))
    for _ in range(19):
        lengths.observe(5, "stop")
    assert lengths.basis == "prior"
    lengths.observe(5, "stop")
    assert lengths.basis == "observed" and lengths.samples == 20
    assert lengths.expected_remaining(0, 4096) == pytest.approx(5.0)


def test_worst_case_prior_expects_every_answer_to_run_to_its_limit() -> None:
    lengths = AnswerLengths(prior_mean=math.inf)
    assert lengths.expected_remaining(0, 4096) == 4096.0
    assert lengths.expected_remaining(96, 100) == 4.0
    assert lengths.allowance(0, 300) == 300


def test_two_point_distribution_exact_conditional_expectations() -> None:
    # half the answers end at 10 tokens, half at 30: S(k) = 1 below 10, 1/2 on [10, 30), 0 from 30
    lengths = _taught((50, 10, "stop"), (50, 30, "stop"))
    assert lengths.expected_remaining(0, 100) == pytest.approx(20.0)  # the mean
    assert lengths.expected_remaining(0, 20) == pytest.approx(15.0)  # E[min(L, 20)] = (10 + 20) / 2
    assert lengths.expected_remaining(5, 100) == pytest.approx(15.0)
    assert lengths.expected_remaining(10, 100) == pytest.approx(20.0)  # still going at 10: it is a 30
    assert lengths.expected_remaining(25, 100) == pytest.approx(5.0)
    assert lengths.expected_remaining(25, 27) == pytest.approx(2.0)  # capped by its limit
    # past every answer seen: the rate of the longer half (50 stops over 1,500 tokens), with one
    # pseudo-answer of the prior's 256 tokens
    q = 1.0 - 51 / (1500 + 256)
    assert lengths.expected_remaining(30, 100) == pytest.approx((1.0 - q**70) / (1.0 - q))


def test_censored_answers_are_not_mistaken_for_natural_ends() -> None:
    # 50 stop at 10 tokens; 50 were cut at their max_tokens of 20 (finish "length": longer than 20)
    lengths = _taught((50, 10, "stop"), (50, 20, "length"))
    assert lengths.expected_remaining(0, 20) == pytest.approx(15.0)  # exactly what min(L, 20) averages
    # one that passed 20 goes on at the longer half's rate (no stop in 1,000 tokens: the pseudo-answer's)
    q = 1.0 - 1 / (1000 + 256)
    assert lengths.expected_remaining(20, 100) == pytest.approx((1.0 - q**80) / (1.0 - q))
    assert lengths.expected_remaining(20, 100) > 25.0
    # treating the cut answers as natural ends would have said ~15 for any limit; here a larger limit is longer
    assert lengths.expected_remaining(0, 100) > lengths.expected_remaining(0, 20) + 10


def test_aborted_and_failed_answers_teach_nothing() -> None:
    lengths = AnswerLengths()
    for reason in ("abort", "error", None):
        lengths.observe(7, reason)
    lengths.observe(0, "stop")
    assert lengths.samples == 0


def test_allowance_is_the_conditional_quantile_capped_by_the_limit() -> None:
    lengths = _taught((96, 10, "stop"), (4, 30, "stop"), quantile=0.95)
    assert lengths.allowance(0, 100) == 10  # 96% end by 10
    assert lengths.allowance(0, 8) == 8  # never more than max_tokens
    assert lengths.allowance(10, 100) == 30  # still going at 10: all of those end at 30
    assert lengths.allowance(29, 30) == 30
    prior = AnswerLengths(prior_mean=256.0, quantile=0.95)
    # the prior's 95th percentile: the least x with (1 - 1/256)^x <= 0.05
    assert prior.allowance(0, 4096) == math.ceil(math.log(0.05) / math.log(1 - 1 / 256))
    assert prior.allowance(0, 300) == 300


def test_the_window_forgets_old_answers() -> None:
    lengths = _taught((1000, 5, "stop"), window=1000)
    assert lengths.expected_remaining(0, 100) == pytest.approx(5.0)
    for _ in range(1000):
        lengths.observe(50, "stop")
    assert lengths.samples == 1000
    assert lengths.expected_remaining(0, 100) == pytest.approx(50.0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_samples"):
        AnswerLengths(window=10, min_samples=11)
    with pytest.raises(ValueError, match="prior_mean"):
        AnswerLengths(prior_mean=0.5)
    with pytest.raises(ValueError, match="quantile"):
        AnswerLengths(quantile=1.0)


_answers = st.lists(
    st.tuples(st.integers(1, 300), st.sampled_from(["stop", "stop", "length"])), min_size=0, max_size=80
)


@settings(max_examples=150, deadline=None)
@given(answers=_answers, generated=st.integers(0, 400), room=st.integers(0, 400))
def test_estimates_stay_within_their_bounds_and_grow_with_the_limit(answers, generated, room) -> None:
    lengths = AnswerLengths(min_samples=1)
    for tokens, reason in answers:
        lengths.observe(tokens, reason)
    limit = generated + room
    expected = lengths.expected_remaining(generated, limit)
    assert min(1.0, room) - 1e-9 <= expected <= room + 1e-9
    assert lengths.expected_remaining(generated, limit + 1) >= expected - 1e-9
    if room >= 1:
        assert generated < lengths.allowance(generated, limit) <= limit


def test_running_requests_count_as_censored_so_the_first_short_answers_do_not_stand_for_all() -> None:
    # 20 answers ended after 10 tokens; 20 more are still running, 100 tokens in
    lengths = _taught((20, 10, "stop"))
    assert lengths.expected_remaining(0, 1000) == pytest.approx(10.0)
    lengths.set_running([100] * 20 + [0])  # (a request that has generated nothing says nothing yet)
    # half are known to run past 100, and the longer half (the running ones) has not stopped once in
    # 2,000 tokens: past 100 the rate is the pseudo-answer's, 1 / (2,000 + 256)
    q = 1.0 - 1 / 2256
    assert lengths.expected_remaining(0, 1000) == pytest.approx(10 + 90 * 0.5 + 0.5 * (1 - q**900) / (1 - q))
    lengths.set_running([])
    assert lengths.expected_remaining(0, 1000) == pytest.approx(10.0)
