"""Stop strings across token boundaries: `StopChecker`, between the detokenizer and the client,
holds back a tail that may still become a stop string, and never emits a stop string or what follows."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["StopChecker", "StopResult"]


@dataclass(frozen=True)
class StopResult:
    """`emit`: text that can be sent now. `stopped`: a stop string was found (emit ends before it)."""

    emit: str
    stopped: bool


class StopChecker:
    """Finds the earliest stop string in a stream of text deltas for one sequence.

    Guarantee: the concatenation of every `emit` (including `flush()`) is the text up to the start
    of the first stop string to complete (when several complete within one delta, the one that
    starts earliest), or all the text when none occurs; emitted text never contains or begins a
    stop string. Held-back text is at most `max(len(stop)) - 1` characters.
    """

    def __init__(self, stop: Iterable[str]) -> None:
        self._stops: tuple[str, ...] = tuple(stop)
        if not all(isinstance(s, str) and s for s in self._stops):
            raise ValueError("stop strings must be non-empty strings")
        self._held = ""
        self._stopped = False

    @property
    def watching(self) -> bool:
        """True when there are stop strings to look for (else `feed` emits every delta as it comes)."""
        return bool(self._stops)

    @property
    def stopped(self) -> bool:
        """True once a stop string has been found; later text is ignored."""
        return self._stopped

    @property
    def held(self) -> str:
        """Text held back because it may be the start of a stop string."""
        return self._held

    def feed(self, delta: str) -> StopResult:
        """Add newly decoded text; return what can be emitted now and whether a stop string ended it."""
        if self._stopped:
            return StopResult("", True)
        if not self._stops:
            return StopResult(delta, False)
        # A match cannot start in already emitted text: anything that could begin one was held.
        text = self._held + delta
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self._stopped = True
            return StopResult(text[:cut], True)
        keep = self._partial_match_length(text)
        self._held = text[len(text) - keep :] if keep else ""
        return StopResult(text[: len(text) - keep], False)

    def flush(self) -> str:
        """At the end of the sequence (no stop string found): the held-back text, now safe to send."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:length]):
                    best = length
                    break
        return best
