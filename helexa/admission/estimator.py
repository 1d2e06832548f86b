"""Wait estimates: when blocks and sequence slots come free, simulated from the work still to do.

The model, deliberately simple and the same everywhere it is used:

- Every admitted sequence runs concurrently; a decode step gives each one token and takes
  `decode_step_seconds`, a prompt token costs `prefill_token_seconds` (the engine's measured averages).
- A sequence holding a reservation releases all its blocks and its slot after its unprefilled prompt
  tokens and the output tokens it is *expected* to generate still (learned from recent answers, see
  lengths.py; never more than its `max_tokens` allows) — an estimate, not the worst-case bound.
- Waiting requests start strictly in FIFO order, each at the first moment both gates pass (blocks
  available >= its blocks, a free slot) and no earlier than the one ahead of it, and then hold their
  blocks for their own expected run time.

Each release carries the expected output tokens it was estimated from, so a decision can show the
basis of its wait (`last_waited_on`).

`FifoPlan` runs that simulation once over the queue and is then extended at the tail in
O(k log n) for k releases passed, which keeps an admission decision cheap behind a long queue.

`RequestSizes` remembers the sizes of recent requests, so the wait of a median-size one can be asked
at any moment (`helexa_admission_estimated_wait_seconds`: the signal a router has from no other engine).
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable


class FifoPlan:
    """Estimated start times of a FIFO queue behind two gates, extendable one request at a time.

    Built from the present (`now`, blocks available, free sequence slots) and each running
    reservation's future release `(finish_time, blocks, expected_tokens)`. `append` admits the next
    request in the simulation and returns its estimated start; `start_of` asks the same without
    changing the plan. After either, `last_waited_on` holds the releases that request waited for.
    """

    __slots__ = ("_time", "_blocks", "_slots", "_events", "last_waited_on")

    def __init__(
        self, now: float, blocks_available: int, slots_available: int, releases: Iterable[tuple[float, int, float]]
    ):
        self._time = now
        self._blocks = blocks_available
        self._slots = slots_available
        self._events: list[tuple[float, int, float]] = list(releases)  # heap of (finish_time, blocks, tokens)
        heapq.heapify(self._events)
        self.last_waited_on: list[tuple[float, int, float]] = []

    @property
    def time(self) -> float:
        """Estimated start of the last request appended (or `now` when none was)."""
        return self._time

    def _advance(self, blocks: int) -> tuple[float, int, int, list[tuple[float, int, float]]]:
        t, avail, slots = self._time, self._blocks, self._slots
        events, popped = self._events, []
        while avail < blocks or slots < 1:
            if not events:
                raise ValueError(
                    f"a request needing {blocks} blocks can never start: at most {avail} blocks and "
                    f"{slots} sequence slots are ever free in this plan"
                )
            event = heapq.heappop(events)
            popped.append(event)
            when, freed = event[0], event[1]
            t = max(t, when)
            avail += freed
            slots += 1
        return t, avail, slots, popped

    def start_of(self, blocks: int) -> float:
        """Estimated start of a request needing `blocks` blocks if it were appended now; the plan is unchanged."""
        return self.append_if_starts_by(blocks, 0.0, -math.inf)[0]

    def append(self, blocks: int, run_seconds: float, expected_tokens: float = 0.0) -> float:
        """Admit the next request (in the simulation): returns its estimated start time."""
        return self.append_if_starts_by(blocks, run_seconds, math.inf, expected_tokens)[0]

    def extend(self, requests: Iterable[tuple[int, float, float]]) -> list[float]:
        """`append` each `(blocks, run_seconds, expected_tokens)` in order; returns their estimated starts.

        One tight loop (a full replan runs it over the whole queue): the same simulation as `append`.
        """
        t, avail, slots, events = self._time, self._blocks, self._slots, self._events
        pop, push, starts = heapq.heappop, heapq.heappush, []
        try:
            for blocks, run_seconds, expected_tokens in requests:
                while avail < blocks or slots < 1:
                    if not events:
                        raise ValueError(
                            f"a request needing {blocks} blocks can never start: at most {avail} "
                            f"blocks and {slots} sequence slots are ever free in this plan"
                        )
                    when, freed, _ = pop(events)
                    t, avail, slots = max(t, when), avail + freed, slots + 1
                avail, slots = avail - blocks, slots - 1
                push(events, (t + run_seconds, blocks, expected_tokens))
                starts.append(t)
        finally:
            self._time, self._blocks, self._slots = t, avail, slots
        return starts

    def append_if_starts_by(
        self, blocks: int, run_seconds: float, latest_start: float, expected_tokens: float = 0.0
    ) -> tuple[float, bool]:
        """`append` when the estimated start is <= `latest_start`, else leave the plan unchanged.

        Returns `(estimated start, appended)`.
        """
        t, avail, slots, popped = self._advance(blocks)
        self.last_waited_on = popped
        if t > latest_start:
            for event in popped:
                heapq.heappush(self._events, event)
            return t, False
        self._time, self._blocks, self._slots = t, avail - blocks, slots - 1
        heapq.heappush(self._events, (t + run_seconds, blocks, expected_tokens))
        return t, True


def retry_after_seconds(wait_seconds: float) -> int:
    """An estimated wait as a Retry-After value: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(wait_seconds - 1e-9))


class RequestSizes:
    """The sizes of the last `window` admitted requests, to ask what a typical one would wait now.

    `observe(prompt_tokens, max_tokens)` once per request admission accepted (granted or queued);
    `median()` is the observed request whose total `prompt_tokens + max_tokens` is the median (the lower
    one of an even count), so it is a size that was really served here and always fits the node. Thread-safe.
    """

    __slots__ = ("_sizes", "_lock")

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._sizes: deque[tuple[int, int]] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, prompt_tokens: int, max_tokens: int) -> None:
        """One request of `prompt_tokens` prompt tokens allowed `max_tokens` output tokens was admitted."""
        with self._lock:
            self._sizes.append((prompt_tokens, max_tokens))

    def median(self) -> tuple[int, int] | None:
        """`(prompt_tokens, max_tokens)` of the median-size recent request, or None before any was seen."""
        with self._lock:
            sizes = sorted(self._sizes, key=lambda s: (s[0] + s[1], s[0]))
        return sizes[(len(sizes) - 1) // 2] if sizes else None

    def median_wait(self, estimate_wait: Callable[[int, int], float], default: tuple[int, int]) -> float:
        """Seconds the median-size request would wait if it arrived now, by `estimate_wait(prompt, max_tokens)`
        (`AdmissionController.estimate_wait`); before any request was seen, the size asked about is `default`."""
        prompt, max_tokens = self.median() or default
        return estimate_wait(prompt, max_tokens)
