"""Wait estimates: when blocks and sequence slots come free, simulated from the work still to do.

The model (deliberately simple, and the same everywhere it is used):

- The engine runs every admitted sequence concurrently; one decode step gives each of them one
  token and takes `decode_step_seconds` (the engine's measured moving average), and prefilling a
  prompt token costs `prefill_token_seconds`. Batch effects are folded into those measured rates.
- A sequence holding a reservation releases it — all its blocks and its sequence slot — after its
  unprefilled prompt tokens and its remaining output tokens, bounded by its `max_tokens`:
  `finish = now + prefill_left * prefill_token_seconds + decode_left * decode_step_seconds`.
  It may stop earlier (end of sequence, stop string), so this is the latest it will finish at
  the measured rate.
- Waiting requests start strictly in FIFO order, each at the first moment both gates pass
  (blocks available >= its blocks, a free sequence slot) and no earlier than the one ahead of it;
  once started it holds its blocks for its own full estimated run time.

`FifoPlan` runs that simulation once over the queue and can then be extended at the tail in
O(k log n) for k releases passed, which is what makes an admission decision cheap with a long queue.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

# Priors used until the engine has measured anything: a small model on one accelerator.
PRIOR_DECODE_STEP_SECONDS = 0.05
PRIOR_PREFILL_TOKEN_SECONDS = 0.0005


@dataclass(frozen=True)
class EngineRates:
    """The engine's measured speed: seconds per decode step and per prefilled prompt token.

    Defaults are priors (`0.05` s per decode step, `0.0005` s per prompt token) used until the
    engine reports a measurement with `AdmissionController.set_rates`.
    """

    decode_step_seconds: float = PRIOR_DECODE_STEP_SECONDS
    prefill_token_seconds: float = PRIOR_PREFILL_TOKEN_SECONDS

    def __post_init__(self) -> None:
        if not (math.isfinite(self.decode_step_seconds) and self.decode_step_seconds > 0):
            raise ValueError(
                f"EngineRates.decode_step_seconds must be finite and > 0, got {self.decode_step_seconds!r}"
            )
        if not (math.isfinite(self.prefill_token_seconds) and self.prefill_token_seconds >= 0):
            raise ValueError(
                f"EngineRates.prefill_token_seconds must be finite and >= 0, got {self.prefill_token_seconds!r}"
            )

    def run_seconds(self, prefill_tokens: int, decode_tokens: int) -> float:
        """Estimated seconds to prefill `prefill_tokens` and then decode `decode_tokens` tokens."""
        return prefill_tokens * self.prefill_token_seconds + decode_tokens * self.decode_step_seconds


class SeqWork(NamedTuple):
    """A sequence as the estimator sees it: the blocks it holds (or will hold) and the work it has left."""

    blocks: int
    prefill_tokens: int
    decode_tokens: int


class FifoPlan:
    """Estimated start times of a FIFO queue behind two gates, extendable one request at a time.

    Built from the present (`now`, blocks available, free sequence slots) and the future release
    of each running reservation (`(finish_time, blocks)`); every `append` admits the next queued
    request in the simulation and returns its estimated start. `start_of` answers the same
    question for a hypothetical next request without changing the plan.
    """

    __slots__ = ("_time", "_blocks", "_slots", "_events")

    def __init__(self, now: float, blocks_available: int, slots_available: int, releases: Iterable[tuple[float, int]]):
        self._time = now
        self._blocks = blocks_available
        self._slots = slots_available
        self._events: list[tuple[float, int]] = list(releases)  # heap of (finish_time, blocks released)
        heapq.heapify(self._events)

    @property
    def time(self) -> float:
        """Estimated start of the last request appended (or `now` when none was)."""
        return self._time

    def _advance(self, blocks: int) -> tuple[float, int, int, list[tuple[float, int]]]:
        t, avail, slots = self._time, self._blocks, self._slots
        events, popped = self._events, []
        while avail < blocks or slots < 1:
            if not events:
                raise ValueError(
                    f"a request needing {blocks} blocks can never start: at most {avail} blocks and {slots} "
                    "sequence slots are ever free in this plan"
                )
            when, freed = heapq.heappop(events)
            popped.append((when, freed))
            if when > t:
                t = when
            avail += freed
            slots += 1
        return t, avail, slots, popped

    def start_of(self, blocks: int) -> float:
        """Estimated start of a request needing `blocks` blocks if it were appended now; the plan is unchanged."""
        t, _, _, popped = self._advance(blocks)
        for event in popped:
            heapq.heappush(self._events, event)
        return t

    def append(self, blocks: int, run_seconds: float) -> float:
        """Admit the next request (in the simulation): returns its estimated start time."""
        t, avail, slots, _ = self._advance(blocks)
        self._time, self._blocks, self._slots = t, avail - blocks, slots - 1
        heapq.heappush(self._events, (t + run_seconds, blocks))
        return t

    def extend(self, requests: Iterable[tuple[int, float]]) -> list[float]:
        """`append` each `(blocks, run_seconds)` in order; returns their estimated starts (one tight loop)."""
        t, avail, slots, events = self._time, self._blocks, self._slots, self._events
        pop, push, starts = heapq.heappop, heapq.heappush, []
        for blocks, run_seconds in requests:
            while avail < blocks or slots < 1:
                if not events:
                    self._time, self._blocks, self._slots = t, avail, slots
                    raise ValueError(
                        f"a request needing {blocks} blocks can never start: at most {avail} blocks and {slots} "
                        "sequence slots are ever free in this plan"
                    )
                when, freed = pop(events)
                if when > t:
                    t = when
                avail += freed
                slots += 1
            avail -= blocks
            slots -= 1
            push(events, (t + run_seconds, blocks))
            starts.append(t)
        self._time, self._blocks, self._slots = t, avail, slots
        return starts

    def append_if_starts_by(self, blocks: int, run_seconds: float, latest_start: float) -> tuple[float, bool]:
        """`append` when the estimated start is <= `latest_start`, else leave the plan unchanged.

        Returns `(estimated start, appended)`; one walk over the releases either way.
        """
        t, avail, slots, popped = self._advance(blocks)
        if t > latest_start:
            for event in popped:
                heapq.heappush(self._events, event)
            return t, False
        self._time, self._blocks, self._slots = t, avail - blocks, slots - 1
        heapq.heappush(self._events, (t + run_seconds, blocks))
        return t, True


def release_times(now: float, rates: EngineRates, running: Iterable[SeqWork]) -> list[tuple[float, int]]:
    """`(finish_time, blocks)` for each running sequence: when its reservation comes back."""
    return [(now + rates.run_seconds(w.prefill_tokens, w.decode_tokens), w.blocks) for w in running]


def estimate_starts(
    now: float,
    rates: EngineRates,
    blocks_available: int,
    slots_available: int,
    running: Sequence[SeqWork],
    waiting: Sequence[SeqWork],
) -> list[float]:
    """Estimated start time of each waiting request (FIFO order), given what is running now.

    `blocks_available` and `slots_available` are what is free at `now`; each running sequence
    returns its blocks and its slot when its work is done; each waiting one starts at the first
    moment both gates pass, never before the one ahead of it. Raises `ValueError` when a waiting
    request needs more than can ever be free.
    """
    plan = FifoPlan(now, blocks_available, slots_available, release_times(now, rates, running))
    return plan.extend((w.blocks, rates.run_seconds(w.prefill_tokens, w.decode_tokens)) for w in waiting)


def retry_after_seconds(wait_seconds: float) -> int:
    """An estimated wait as a Retry-After value: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(wait_seconds - 1e-9))
