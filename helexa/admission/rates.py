"""The engine's measured speed, which every wait estimate is made from: `EngineRates` and the `RateTracker`."""

from __future__ import annotations

import collections
import math
import statistics
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


class RateTracker:
    """The median measured step costs over the last `window` steps, safe to read from any thread.

    `decode_step_seconds` is the wall time in which each running sequence gains one token: a step that
    decodes, divided by the tokens a sequence gained in it (more than one where speculative drafts were
    kept); `prefill_token_seconds` the cost of one prompt token; a mixed step is split by the
    current estimates' shares. Until a cost has been measured it is `EngineRates()`' prior. A median, not
    a moving average: a burst of slow steps shorter than half the window (a storm of arriving requests
    competing for the interpreter, a page fault) does not move it, while a lasting change does within
    half a window.
    """

    def __init__(self, window: int = 64) -> None:
        self._decode: collections.deque[float] = collections.deque(maxlen=window)
        self._prefill: collections.deque[float] = collections.deque(maxlen=window)
        self._lock = threading.Lock()

    @classmethod
    def calibrated(cls, decode_step_seconds: float, prefill_token_seconds: float) -> RateTracker:
        """A tracker starting from measured costs (each counted as one sample), not from the priors."""
        tracker = cls()
        tracker._decode.append(max(decode_step_seconds, 1e-6))
        tracker._prefill.append(max(prefill_token_seconds, 0.0))
        return tracker

    @property
    def decode_step_seconds(self) -> float:
        with self._lock:
            return statistics.median(self._decode) if self._decode else EngineRates.decode_step_seconds

    @property
    def prefill_token_seconds(self) -> float:
        with self._lock:
            return statistics.median(self._prefill) if self._prefill else EngineRates.prefill_token_seconds

    def observe_step(
        self, seconds: float, num_decode_tokens: int, num_prefill_tokens: int, decode_yield: float = 1.0
    ) -> None:
        """Fold one step's wall time in; a mixed step is split by the current estimates' shares. `decode_yield`:
        tokens each decoding sequence gained in the step, on average (above 1 where speculative drafts were
        kept): the decode sample is the time in which a sequence gains one token, what every estimate needs."""
        if seconds <= 0 or (num_decode_tokens == 0 and num_prefill_tokens == 0):
            return
        decode_now, prefill_now = self.decode_step_seconds, self.prefill_token_seconds
        prefill_est = num_prefill_tokens * prefill_now
        decode_est = decode_now if num_decode_tokens else 0.0
        total_est = prefill_est + decode_est
        with self._lock:
            if num_decode_tokens:
                share = seconds * (decode_est / total_est) if total_est > 0 else seconds
                self._decode.append(share / max(1.0, decode_yield))
            if num_prefill_tokens:
                share = seconds * (prefill_est / total_est) if total_est > 0 else seconds
                self._prefill.append(share / num_prefill_tokens)

    def rates(self) -> EngineRates:
        """The current medians as one consistent `EngineRates`."""
        return EngineRates(
            decode_step_seconds=max(self.decode_step_seconds, 1e-6),
            prefill_token_seconds=max(self.prefill_token_seconds, 0.0),
        )
