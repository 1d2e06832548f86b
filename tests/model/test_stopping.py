"""Stop strings across token boundaries, held-back tails, and finish reasons."""

from __future__ import annotations

import random

import pytest

from helexa.model.text.stopping import StopChecker, StopResult


def _run(stops: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    checker = StopChecker(stops)
    emitted: list[str] = []
    stopped = False
    for delta in deltas:
        result = checker.feed(delta)
        emitted.append(result.emit)
        stopped = result.stopped
        if stopped:
            break
    emitted.append(checker.flush())
    return "".join(emitted), stopped, emitted


def test_stop_string_spanning_tokens_is_trimmed() -> None:
    text, stopped, emitted = _run(["</answer>"], ["The ans", "wer is 4", "2</ans", "wer> tail", "more"])
    assert (text, stopped) == ("The answer is 42", True)
    assert emitted[:3] == ["The ans", "wer is 4", "2"]  # "</ans" was held back at step 3
    assert emitted[3] == ""


def test_held_tail_released_when_it_stops_matching() -> None:
    checker = StopChecker(["STOP"])
    assert checker.feed("go ST") == StopResult("go ", False)
    assert checker.held == "ST"
    assert checker.feed("OR") == StopResult("STOR", False)  # "STOR" cannot become "STOP"
    assert checker.feed("S") == StopResult("", False)
    assert checker.flush() == "S"  # end of sequence: the held tail is plain text


def test_stop_at_the_very_start() -> None:
    assert _run(["<|"], ["<", "|x"])[:2] == ("", True)
    assert _run(["hello"], ["hello world"])[:2] == ("", True)


def test_multiple_stop_strings_earliest_start_wins() -> None:
    assert _run(["bb", "abc"], ["xxabcbb"])[:2] == ("xx", True)
    assert _run(["\n\n", "User:"], ["Hi", "\n", "User", ": hey"])[:2] == ("Hi\n", True)
    # Streaming: the first stop string to complete ends the text.
    assert _run(["abcd", "bc"], ["ab", "c", "d"])[:2] == ("a", True)
    assert _run(["abcd", "bc"], ["ab", "cd"])[:2] == ("", True)  # both complete in one delta


def test_after_stop_nothing_more_is_emitted() -> None:
    checker = StopChecker(["x"])
    assert checker.feed("ax") == StopResult("a", True)
    assert checker.feed("more") == StopResult("", True)
    assert checker.flush() == "" and checker.stopped


def test_no_stop_strings_passes_through() -> None:
    assert _run([], ["a", "b"]) == ("ab", False, ["a", "b", ""])


def test_random_splits_match_a_whole_text_search() -> None:
    rng = random.Random(5)
    alphabet = "ab<>/é中"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        out, stopped, emitted = _run(stops, deltas)
        # Reference: the stop string whose end comes first in the text (ties: earliest start).
        hits = [(i + len(s), i) for s in stops for i in range(len(text)) if text.startswith(s, i)]
        if not hits:
            assert (out, stopped) == (text, False)
            continue
        end, _ = min(hits)
        # Within one delta several stops may complete; the checker then cuts at the earliest start.
        delta_end = next(b for b in [*cuts, len(text)] if b >= end)
        start = min(i for s in stops for i in range(len(text)) if text.startswith(s, i) and i + len(s) <= delta_end)
        assert stopped and out == text[:start], (text, stops, deltas)
        assert all(s not in out for s in stops)


def test_bad_stop_strings() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker([""])
