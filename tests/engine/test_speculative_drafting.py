"""Drafting for speculative decoding: prompt lookup against a brute-force reference (its compiled tables and
its Python dicts, and each against the other on long growing lists), the sessions' bounded and salted
memory, the adaptive draft length, and how the scheduler budgets drafts."""

from __future__ import annotations

import random
import tracemalloc
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helexa.admission.rates import RateTracker
from helexa.engine.scheduler import schedule
from helexa.engine.speculative import Drafter, DraftState, NgramIndex, SessionOutputs, ngram


@pytest.fixture(params=[False, True], ids=["dicts", "compiled"])
def native(request: pytest.FixtureRequest) -> bool:
    """Each test runs on both kinds of tables (the compiled ones skip, with the reason, where they cannot build)."""
    if request.param and not ngram.compiled_tables():
        pytest.skip(f"the compiled n-gram tables are unavailable here: {ngram.native_unavailable_reason()}")
    return request.param


def _reference(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """The latest earlier occurrence of the longest suffix of min_n..max_n tokens; what followed it."""
    end = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > end:
            continue
        tail = tokens[end - n :]
        for j in range(end - 1, n - 1, -1):  # j: the position right after an occurrence ending before `end`
            if tokens[j - n : j] == tail:
                extended = list(tokens)  # the text repeating with period end - j, as far as k tokens need
                while len(extended) < j + k:
                    extended.append(extended[len(extended) - (end - j)])
                return tuple(extended[j : j + k]) if k else ()
    return ()


@pytest.mark.parametrize("native", [False, True], ids=["dicts", "compiled"])
@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=120), st.integers(1, 3), st.integers(0, 2), st.integers(0, 9))
def test_prompt_lookup_matches_the_brute_force_reference_as_the_list_grows(native, tokens, min_n, extra, k) -> None:
    if native and not ngram.compiled_tables():
        pytest.skip(f"the compiled n-gram tables are unavailable here: {ngram.native_unavailable_reason()}")
    index = NgramIndex(min_n, min_n + extra, native=native)
    assert index.native is native
    for end in range(len(tokens) + 1):  # the same list, one token longer each call (incremental indexing)
        assert index.propose(tokens[:end], k) == _reference(tokens[:end], k, min_n, min_n + extra)


def test_prompt_lookup_prefers_the_longest_match_and_the_latest_occurrence(native: bool) -> None:
    index = NgramIndex(1, 3, native=native)
    tokens = [5, 1, 2, 3, 9, 9, 2, 3, 7, 7, 1, 2, 3]
    assert index.propose(tokens, 4) == (9, 9, 2, 3)  # "1 2 3" matched at 1..3 (length 3), not "2 3" at 6..7
    index = NgramIndex(2, 2, native=native)
    assert index.propose([1, 2, 8, 1, 2, 9, 1, 2], 2) == (9, 1)  # the latest of two occurrences
    assert NgramIndex(2, 3, native=native).propose([4, 1, 2, 3, 1, 2, 3], 7) == (1, 2, 3, 1, 2, 3, 1)  # repeating
    assert NgramIndex(2, 4, native=native).propose([1, 2, 3], 5) == ()
    assert NgramIndex(2, 4, native=native).propose([1, 2, 3, 1, 2], 0) == ()


def test_a_list_that_shrank_is_indexed_afresh(native: bool) -> None:
    index = NgramIndex(2, 2, native=native)
    assert index.propose([1, 2, 3, 1, 2], 3) == (3, 1, 2)
    assert index.propose([7, 8, 9], 3) == ()  # another (shorter) list: nothing of the first one is proposed
    assert len(index) == 3
    with pytest.raises(ValueError):
        NgramIndex(3, 2, native=native)


def test_a_token_id_outside_int32_is_refused_and_changes_nothing(native: bool) -> None:
    index = NgramIndex(2, 2, native=native)
    assert index.propose([1, 2, 3, 1, 2], 3) == (3, 1, 2)
    with pytest.raises(OverflowError):
        index.propose([1, 2, 3, 1, 2, 2**31, 1, 2], 3)
    assert len(index) == 5
    assert index.propose([1, 2, 3, 1, 2, 3, 1, 2], 3) == (3, 1, 2)


@pytest.mark.parametrize("vocab", [3, 50, 40_000])
def test_compiled_and_dict_tables_agree_on_long_growing_lists(vocab: int) -> None:
    """Thousands of tokens, grown by steps of 1 to 9 tokens (a decode step with an accepted draft) or by a
    whole prompt: the tables grow many times, a small vocabulary makes every n-gram recur (the slots of equal
    keys are found by comparing tokens), a large one makes most n-grams new. Each step, both kinds propose the
    same draft, and a continuation from another list's tail agrees too."""
    if not ngram.compiled_tables():
        pytest.skip(f"the compiled n-gram tables are unavailable here: {ngram.native_unavailable_reason()}")
    rng = random.Random(vocab)
    text = [rng.randrange(vocab) for _ in range(1500)]
    for _ in range(60):  # stretches copied from earlier in the text, as an agent echoing what it read
        at, to = rng.randrange(len(text) - 40), rng.randrange(len(text))
        text[to:to] = text[at : at + rng.randrange(5, 40)]
    compiled, dicts = NgramIndex(2, 5, native=True), NgramIndex(2, 5, native=False)
    end = 700  # a prompt, then decode steps
    while end <= len(text):
        tokens, k = text[:end], rng.randrange(1, 10)
        assert compiled.propose(tokens, k) == dicts.propose(tokens, k)
        tail = [rng.randrange(vocab) for _ in range(rng.randrange(1, 7))]
        shorter = tokens[: rng.randrange(1, end + 1)]  # `text` shorter than what is indexed: nothing past it
        assert compiled.continuation(shorter, tail, k) == dicts.continuation(shorter, tail, k)
        end += rng.randrange(1, 10)
    assert len(compiled) == len(dicts)


def test_the_compiled_index_holds_a_long_prompt_in_a_few_dozen_bytes_a_token() -> None:
    """The module doc's figure: a copy of the tokens and three tables at most half full, 28-52 bytes a token
    (the dicts' tables hold ~400)."""
    if not ngram.compiled_tables():
        pytest.skip(f"the compiled n-gram tables are unavailable here: {ngram.native_unavailable_reason()}")
    rng = random.Random(0)
    tokens = [rng.randrange(49152) for _ in range(8192)] * 2  # the index is sized by positions
    tracemalloc.start()
    try:
        index = NgramIndex(2, 4, native=True)
        index.extend(tokens)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(index) == len(tokens)
    assert 28 * len(tokens) <= held <= 56 * len(tokens)
    assert index.propose(tokens[:8192] + tokens[:3], 4) == tuple(tokens[3:7])  # the second half: its first copy


def test_session_outputs_draft_within_one_salted_session_only(native: bool) -> None:
    store = SessionOutputs(min_n=2, max_n=3, native=native)
    assert store.propose("tenant-a", "agent-1", [10, 11], 3) == ()
    store.record("tenant-a", "agent-1", [10, 11, 12, 13, 14])
    assert store.propose("tenant-a", "agent-1", [99, 11, 12], 3) == (13, 14)  # never past the output's end
    assert store.propose("tenant-b", "agent-1", [99, 11, 12], 3) == ()  # another tenant: nothing
    assert store.propose("tenant-a", "agent-2", [99, 11, 12], 3) == ()
    assert store.propose(None, "agent-1", [99, 11, 12], 3) == ()
    store.record("tenant-a", "agent-1", [11, 12, 20])  # the latest output wins
    assert store.propose("tenant-a", "agent-1", [11, 12], 3) == (20,)


def test_session_outputs_are_bounded_per_session_and_in_all(native: bool) -> None:
    store = SessionOutputs(min_n=2, max_n=2, max_session_tokens=8, max_tokens=12, native=native)
    store.record(None, "s1", [1, 2, 3, 4])
    store.record(None, "s1", [5, 6, 7, 8])  # 10 tokens with separators: the oldest output goes
    assert store.num_tokens <= 8
    assert store.propose(None, "s1", [1, 2], 2) == ()
    assert store.propose(None, "s1", [5, 6], 2) == (7, 8)
    store.record(None, "s2", [1, 2, 3, 4, 5, 6, 7])  # 5 + 8 > 12 in all: the least recently used session goes
    assert store.num_tokens <= 12 and store.num_sessions == 1
    assert store.propose(None, "s1", [5, 6], 2) == ()
    assert store.propose(None, "s2", [1, 2], 2) == (3, 4)


def _best_length(acceptance: float, row_cost: float, max_length: int) -> int:
    """The draft length maximising expected tokens per unit of time, by brute force."""
    gains = {
        k: (1 + sum(acceptance**i for i in range(1, k + 1))) / (1 + row_cost * k) for k in range(1, max_length + 1)
    }
    return max(gains, key=lambda k: (gains[k], -k))


def test_the_draft_length_is_what_pays_best_at_the_measured_acceptance_and_row_cost() -> None:
    state = DraftState(2, 4, max_length=8)
    assert state.acceptance == pytest.approx(0.6)
    assert state.next_length(0.05) == _best_length(0.6, 0.05, 8) == 4
    assert state.next_length(0.3) == _best_length(0.6, 0.3, 8) == 1  # dear rows: a short draft
    for _ in range(10):  # drafts kept whole: long drafts, and longer the cheaper a row is
        state.observe(8, 8)
    assert state.acceptance > 0.95
    assert state.next_length(0.01) == state.next_length(0.3) == 8
    for _ in range(3):  # now every draft is cut at once: shorter drafts
        state.observe(2, 0)
    assert 1 <= state.next_length(0.05) < 4
    for _ in range(5):  # and then not even that pays: one-token probes between longer and longer pauses
        state.observe(1, 0)
    assert state.acceptance < 0.05
    lengths = [state.next_length(0.05) for _ in range(16)]
    assert lengths == [1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    state.observe(1, 1)  # a probe kept: the pause starts again from one step
    for _ in range(5):
        state.observe(4, 4)
    assert state.next_length(0.05) > 1


def test_the_drafter_counts_what_it_verified() -> None:
    drafter = Drafter("ngram", 4, 2, 3)
    state = drafter.new_state()
    assert drafter.propose([1, 2, 3, 1, 2], state, 10, None, None) == (3, 1, 2, 3)  # the period, repeated
    assert drafter.propose([1, 2, 3, 1, 2], state, 1, None, None) == (3,)  # and at the limit
    drafter.verified(state, 2, 1)
    assert drafter.stats.snapshot()["spec_acceptance_rate"] == 0.5
    assert drafter.stats.mean_accepted_length == 1.0
    with pytest.raises(ValueError):
        Drafter("off", 4, 2, 3)


@dataclass(eq=False)
class _Seq:
    num_tokens: int
    num_computed: int


def test_drafts_take_only_the_budget_the_decodes_leave() -> None:
    a, b, c, p = _Seq(10, 9), _Seq(20, 19), _Seq(5, 4), _Seq(50, 0)
    drafts = {a: (1, 2, 3, 4), b: (5, 6, 7)}
    chunks = schedule([a, b, c, p], 8, drafts=drafts)
    # three decodes first (3 tokens), then a's draft (4), then 1 of b's; the prefill gets nothing
    assert [(ch.seq, ch.num_new, ch.draft) for ch in chunks] == [(a, 5, (1, 2, 3, 4)), (b, 2, (5,)), (c, 1, ())]
    chunks = schedule([a, p], 64, drafts={a: (1, 2)})
    assert [(ch.num_new, ch.samples, ch.draft) for ch in chunks] == [(3, True, (1, 2)), (50, True, ())]


def test_admission_rates_count_the_tokens_a_decode_step_yields() -> None:
    """A 30 ms decode step in which each sequence kept 2 draft tokens (3 tokens) is 10 ms per token: the time
    a wait estimate multiplies by the tokens still to generate."""
    tracker = RateTracker()
    tracker.observe_step(0.03, 4, 0, decode_yield=3.0)
    assert tracker.decode_step_seconds == pytest.approx(0.01)
    tracker = RateTracker()
    tracker.observe_step(0.03, 4, 0)
    assert tracker.decode_step_seconds == pytest.approx(0.03)
