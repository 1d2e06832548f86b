"""The engine's measured speed, which every wait estimate is made from: `EngineRates` and the `RateTracker`
(its medians are `RecentMedian`s)."""

from __future__ import annotations

import bisect
import collections
import math
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineRates:
    """Seconds per decode step, per prefilled prompt token and per prompt token loaded from a tier below the pool.

    The defaults are priors for a small model on one accelerator, used until the engine has measured. Until a
    tier load has been measured (`load_token_seconds` None) a token to load is priced as one to compute.
    """

    decode_step_seconds: float = 0.05
    prefill_token_seconds: float = 0.0005
    load_token_seconds: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.decode_step_seconds) and self.decode_step_seconds > 0):
            raise ValueError(
                f"EngineRates.decode_step_seconds must be finite and > 0, got {self.decode_step_seconds!r}"
            )
        if not (math.isfinite(self.prefill_token_seconds) and self.prefill_token_seconds >= 0):
            raise ValueError(
                f"EngineRates.prefill_token_seconds must be finite and >= 0, got {self.prefill_token_seconds!r}"
            )
        load = self.load_token_seconds
        if load is not None and not (math.isfinite(load) and load >= 0):
            raise ValueError(f"EngineRates.load_token_seconds must be finite and >= 0 (or None), got {load!r}")

    def run_seconds(self, prefill_tokens: float, decode_tokens: float, load_tokens: float = 0.0) -> float:
        """Estimated seconds to load `load_tokens` prompt tokens from a tier, prefill `prefill_tokens` and then
        decode `decode_tokens` tokens."""
        load = self.load_token_seconds if self.load_token_seconds is not None else self.prefill_token_seconds
        compute = prefill_tokens * self.prefill_token_seconds + decode_tokens * self.decode_step_seconds
        return load_tokens * load + compute


def _nanoseconds(seconds: float) -> int:
    return round(seconds * 1e9)


class RecentMedian:
    """The median of the samples taken over the last `horizon_seconds` of engine work, safe only under a caller's lock.

    Each sample carries the seconds of work it stands for (counted in whole nanoseconds, so a server running
    for months sums no rounding error into the span). The oldest samples leave once the rest still span
    `horizon_seconds` of work, but the newest `min_samples` always stay and never more than `max_samples`
    are kept. The horizon is counted in work, not in wall time, so an idle hour ages nothing. Counting
    samples over a span of work is what makes the median robust to a burst of slow steps: a storm of
    arriving requests that starves the loop for a second adds few samples (they are slow), against the
    many fast ones of the seconds before it; a lasting change, fast or slow, owns the median once it
    has run for about half the horizon or more (how much more depends on how much slower it is).
    Adding a sample is O(n) memory moves at worst (a few microseconds at `max_samples`), reading the
    median O(1).
    """

    __slots__ = ("_horizon", "_min", "_max", "_order", "_sorted", "_work")

    def __init__(self, horizon_seconds: float, min_samples: int, max_samples: int) -> None:
        if not (math.isfinite(horizon_seconds) and horizon_seconds >= 0):
            raise ValueError(f"horizon_seconds must be finite and >= 0, got {horizon_seconds!r}")
        if not 1 <= min_samples <= max_samples:
            raise ValueError(f"need 1 <= min_samples <= max_samples, got {min_samples} and {max_samples}")
        self._horizon, self._min, self._max = _nanoseconds(horizon_seconds), min_samples, max_samples
        self._order: collections.deque[tuple[float, int]] = collections.deque()  # (value, work ns), oldest first
        self._sorted: list[float] = []
        self._work = 0  # ns of work the kept samples stand for

    def __len__(self) -> int:
        return len(self._order)

    def add(self, value: float, work_seconds: float) -> None:
        """One finite sample standing for `work_seconds` (>= 0) of the engine's work."""
        order, work = self._order, _nanoseconds(work_seconds)
        order.append((value, work))
        bisect.insort(self._sorted, value)
        self._work += work
        while len(order) > self._max or (len(order) > self._min and self._work - order[0][1] >= self._horizon):
            old, work = order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
            self._work -= work

    def median(self) -> float | None:
        """The median of the samples kept (the mean of the middle two of an even count); None before any."""
        values, n = self._sorted, len(self._sorted)
        if not n:
            return None
        mid = n // 2
        return values[mid] if n % 2 else (values[mid - 1] + values[mid]) / 2


class RateTracker:
    """The median measured step costs over the last `horizon_seconds` of the engine's work, safe to read from any
    thread.

    `decode_step_seconds` is the wall time in which each running sequence gains one token: a step that
    decodes, divided by the tokens a sequence gained in it (more than one where speculative drafts were
    kept); `prefill_token_seconds` the cost of one prompt token; a mixed step is split by the
    current estimates' shares. Until a cost has been measured it is `EngineRates()`' prior.

    A median over a span of work (`RecentMedian`: at least the newest `window` samples, at most
    `max_samples`), not a moving average nor a median of a fixed count: a storm of arriving requests
    competing for the interpreter or the cores slows a second or two of steps several times over, and
    the estimates made during it are for the queue that drains after it. Over the last 64 steps such a
    storm owned the median within a fraction of a second (a wait estimate jumped 9x at the same queue
    depth); over 10 s of work it needs most of those 10 s, while a lasting change moves it within them.
    """

    def __init__(self, window: int = 64, *, horizon_seconds: float = 10.0, max_samples: int = 4096) -> None:
        self._decode = RecentMedian(horizon_seconds, window, max(window, max_samples))
        self._prefill = RecentMedian(horizon_seconds, window, max(window, max_samples))
        self._lock = threading.Lock()

    @classmethod
    def calibrated(cls, decode_step_seconds: float, prefill_token_seconds: float) -> RateTracker:
        """A tracker starting from measured costs (each counted as one sample), not from the priors."""
        tracker = cls()
        decode, prefill = max(decode_step_seconds, 1e-6), max(prefill_token_seconds, 0.0)
        tracker._decode.add(decode, decode)
        tracker._prefill.add(prefill, prefill)
        return tracker

    @property
    def decode_step_seconds(self) -> float:
        with self._lock:
            median = self._decode.median()
        return EngineRates.decode_step_seconds if median is None else median

    @property
    def prefill_token_seconds(self) -> float:
        with self._lock:
            median = self._prefill.median()
        return EngineRates.prefill_token_seconds if median is None else median

    def observe_step(
        self, seconds: float, num_decode_tokens: int, num_prefill_tokens: int, decode_yield: float = 1.0
    ) -> None:
        """Fold one step's wall time in; a mixed step is split by the current estimates' shares. `decode_yield`:
        tokens each decoding sequence gained in the step, on average (above 1 where speculative drafts were
        kept): the decode sample is the time in which a sequence gains one token, what every estimate needs.
        A time that is not a finite positive number is ignored."""
        if not (math.isfinite(seconds) and seconds > 0) or (num_decode_tokens == 0 and num_prefill_tokens == 0):
            return
        decode_now, prefill_now = self.decode_step_seconds, self.prefill_token_seconds
        prefill_est = num_prefill_tokens * prefill_now
        decode_est = decode_now if num_decode_tokens else 0.0
        total_est = prefill_est + decode_est
        with self._lock:
            if num_decode_tokens:
                share = seconds * (decode_est / total_est) if total_est > 0 else seconds
                self._decode.add(share / max(1.0, decode_yield), share)
            if num_prefill_tokens:
                share = seconds * (prefill_est / total_est) if total_est > 0 else seconds
                self._prefill.add(share / num_prefill_tokens, share)

    def rates(self) -> EngineRates:
        """The current medians as one consistent `EngineRates`."""
        return EngineRates(
            decode_step_seconds=max(self.decode_step_seconds, 1e-6),
            prefill_token_seconds=max(self.prefill_token_seconds, 0.0),
        )
