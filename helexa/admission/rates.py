"""The engine's measured speed, which every wait estimate is made from: `EngineRates` and the `RateTracker`."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

# One step may move an average by at most this factor: a stall (a page fault, a busy neighbour)
# should not turn into a minutes-long Retry-After, while a real change still shows within a few steps.
_MAX_JUMP = 4.0


@dataclass(frozen=True)
class EngineRates:
    """Seconds per decode step and per prefilled prompt token.

    The defaults are priors for a small model on one accelerator, used until the engine has measured.
    """

    decode_step_seconds: float = 0.05
    prefill_token_seconds: float = 0.0005

    def __post_init__(self) -> None:
        if not (math.isfinite(self.decode_step_seconds) and self.decode_step_seconds > 0):
            raise ValueError(
                f"EngineRates.decode_step_seconds must be finite and > 0, got {self.decode_step_seconds!r}"
            )
        if not (math.isfinite(self.prefill_token_seconds) and self.prefill_token_seconds >= 0):
            raise ValueError(
                f"EngineRates.prefill_token_seconds must be finite and >= 0, got {self.prefill_token_seconds!r}"
            )

    def run_seconds(self, prefill_tokens: float, decode_tokens: float) -> float:
        """Estimated seconds to prefill `prefill_tokens` and then decode `decode_tokens` tokens."""
        return prefill_tokens * self.prefill_token_seconds + decode_tokens * self.decode_step_seconds


@dataclass
class RateTracker:
    """Exponential moving averages of measured step costs, safe to read from any thread.

    `decode_step_seconds` is the wall time of one step that decodes (each running sequence gains a
    token per step); `prefill_token_seconds` the cost of one prompt token. Both start at
    `EngineRates()`' priors. A sample more than 4x the current average is clipped to that before it is
    folded in, so one stalled step cannot inflate every estimate.
    """

    decode_step_seconds: float = EngineRates.decode_step_seconds
    prefill_token_seconds: float = EngineRates.prefill_token_seconds
    alpha: float = 0.2
    decode_samples: int = 0
    prefill_samples: int = 0
    python_overhead_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def calibrated(cls, decode_step_seconds: float, prefill_token_seconds: float) -> RateTracker:
        """A tracker starting from measured costs (each counted as one sample), not from the priors."""
        tracker = cls()
        tracker.decode_step_seconds = max(decode_step_seconds, 1e-6)
        tracker.prefill_token_seconds = max(prefill_token_seconds, 0.0)
        tracker.decode_samples = tracker.prefill_samples = 1
        return tracker

    def observe_step(
        self, seconds: float, num_decode_tokens: int, num_prefill_tokens: int, overhead_seconds: float = 0.0
    ) -> None:
        """Fold one step's wall time in; a mixed step is split by the current estimates' shares."""
        if seconds <= 0 or (num_decode_tokens == 0 and num_prefill_tokens == 0):
            return
        with self._lock:
            prefill_est = num_prefill_tokens * self.prefill_token_seconds
            decode_est = self.decode_step_seconds if num_decode_tokens else 0.0
            total_est = prefill_est + decode_est
            if num_decode_tokens:
                share = seconds * (decode_est / total_est) if total_est > 0 else seconds
                self.decode_step_seconds = self._ema(self.decode_step_seconds, share, self.decode_samples)
                self.decode_samples += 1
            if num_prefill_tokens:
                share = seconds * (prefill_est / total_est) if total_est > 0 else seconds
                self.prefill_token_seconds = self._ema(
                    self.prefill_token_seconds, share / num_prefill_tokens, self.prefill_samples
                )
                self.prefill_samples += 1
            self.python_overhead_seconds = self._ema(
                self.python_overhead_seconds, overhead_seconds, self.decode_samples + self.prefill_samples - 1
            )

    def _ema(self, old: float, new: float, samples: int) -> float:
        if samples == 0:
            return new
        if old > 0:
            new = min(new, _MAX_JUMP * old)
        return (1 - self.alpha) * old + self.alpha * new

    def rates(self) -> EngineRates:
        """The current averages as one consistent `EngineRates`."""
        with self._lock:
            return EngineRates(
                decode_step_seconds=max(self.decode_step_seconds, 1e-6),
                prefill_token_seconds=max(self.prefill_token_seconds, 0.0),
            )
