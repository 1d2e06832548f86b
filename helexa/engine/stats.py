"""Live engine rates that admission uses to estimate waits: moving averages of step costs."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from helexa.admission import EngineRates
from helexa.admission.estimator import PRIOR_DECODE_STEP_SECONDS, PRIOR_PREFILL_TOKEN_SECONDS

# One step may move an average by at most this factor: a stall (a page fault, a busy neighbour)
# should not turn into a minutes-long Retry-After, while a real change still shows within a few steps.
_MAX_JUMP = 4.0


@dataclass
class RateTracker:
    """Exponential moving averages of measured step costs, safe to read from any thread.

    `decode_step_seconds` is the wall time of one engine step that decodes (every running
    sequence advances one token per step, so a sequence with R tokens left needs about
    R × decode_step_seconds). `prefill_token_seconds` is the cost of one prompt token. Before the
    first measurement both hold admission's priors (`PRIOR_DECODE_STEP_SECONDS`,
    `PRIOR_PREFILL_TOKEN_SECONDS`). A sample more than `_MAX_JUMP` times the current average is
    clipped to that before it is folded in, so one stalled step cannot inflate every estimate.
    """

    decode_step_seconds: float = PRIOR_DECODE_STEP_SECONDS
    prefill_token_seconds: float = PRIOR_PREFILL_TOKEN_SECONDS
    alpha: float = 0.2
    decode_samples: int = 0
    prefill_samples: int = 0
    python_overhead_seconds: float = 0.0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def observe_step(self, seconds: float, num_decode_tokens: int, num_prefill_tokens: int,
                     overhead_seconds: float = 0.0) -> None:
        """Fold one step's wall time into the averages, splitting it between decode and prefill.

        A mixed step is attributed by the current estimates' shares so neither average absorbs
        the other's cost.
        """
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
                per_token = share / num_prefill_tokens
                self.prefill_token_seconds = self._ema(self.prefill_token_seconds, per_token, self.prefill_samples)
                self.prefill_samples += 1
            self.python_overhead_seconds = self._ema(self.python_overhead_seconds, overhead_seconds,
                                                     self.decode_samples + self.prefill_samples - 1)

    def _ema(self, old: float, new: float, samples: int) -> float:
        if samples == 0:
            return new
        if old > 0:
            new = min(new, _MAX_JUMP * old)
        return (1 - self.alpha) * old + self.alpha * new

    def rates(self) -> EngineRates:
        """The current averages as the admission controller's `EngineRates` (a consistent snapshot)."""
        with self._lock:
            return EngineRates(decode_step_seconds=max(self.decode_step_seconds, 1e-6),
                               prefill_token_seconds=max(self.prefill_token_seconds, 0.0))
