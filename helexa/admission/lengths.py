"""How long answers really are: a window of finished requests and the expectations admission plans with.

Every finished request is one observation of its answer's natural length `L` (output tokens up to
and including the one that ended it):

- finish reason "stop" (EOS, a stop token or string): `L` is exactly its output length;
- finish reason "length" (it reached `max_tokens`): `L` is only known to exceed it (censored).

From the most recent `window` observations `AnswerLengths` keeps the Kaplan-Meier estimate of the
survival `S(k) = P(L > k)`, which uses censored answers without mistaking them for natural ends.
Requests still running count too, censored at what they have generated (`set_running`): without them
the answers that finished first — the short ones — would stand for all of them, and a node that has
just started would expect every answer to be as short as the first few.

Beyond the longest observation it continues with a constant per-token stop rate, that of the longer
half of the answers (lengths are heavy-tailed: the long ones end more slowly), so a request that has
outlived every answer seen so far is still expected to end at the rate long answers end. With fewer
than `min_samples` observations it uses the stated prior instead: answers end at a constant rate
with mean `prior_mean` tokens (`inf`: every answer runs to its limit, the worst case).

A running request that has generated `g` tokens and holds the limit `m` is expected to generate
`E[min(L, m) - g | L > g] = sum_{k=g}^{m-1} S(k) / S(g)` more: the estimate conditions on what it has
already produced and never exceeds its limit.
"""

from __future__ import annotations

import bisect
import collections
import collections.abc
import math

# Until this many answers have finished, estimates use the prior.
MIN_SAMPLES = 20
# The prior: answers end at a constant per-token rate with this mean length (a short chat answer).
PRIOR_MEAN_TOKENS = 256.0
# The recent answers the estimate is made from.
WINDOW = 1000
# The adaptive policy's output allowance: this quantile of the (conditional) answer length.
ALLOWANCE_QUANTILE = 0.95


class _Survival:
    """`S(k) = P(L > k)` as a step function over breakpoints, then a geometric tail; its partial sums."""

    __slots__ = ("times", "surv", "cum", "hazard", "_by_limit")

    def __init__(self, times: list[int], surv: list[float], hazard: float) -> None:
        # S(k) = 1 for k < times[0]; S(k) = surv[i] for times[i] <= k < times[i+1]; past times[-1] it
        # falls by (1 - hazard) per token.
        self.times, self.surv, self.hazard = times, surv, hazard
        cum, prev_t, prev_s, total = [], 0, 1.0, 0.0
        for t, s in zip(times, surv):
            total += (t - prev_t) * prev_s
            cum.append(total)  # cum[i] = sum_{k < times[i]} S(k)
            prev_t, prev_s = t, s
        self.cum = cum
        self._by_limit: dict[int, float] = {}  # expected_remaining(0, m), asked for every queued request

    def _geometric_sum(self, j: int) -> float:
        """sum_{k=0}^{j-1} (1 - hazard)^k."""
        if j <= 0:
            return 0.0
        h = self.hazard
        return float(j) if h <= 0.0 else (1.0 - (1.0 - h) ** j) / h

    def _index(self, k: int) -> int:
        """The last breakpoint at or before `k` (-1 before the first)."""
        return bisect.bisect_right(self.times, k) - 1

    def at(self, k: int) -> float:
        """`S(k)`."""
        i = self._index(k)
        if i < 0:
            return 1.0
        if i == len(self.times) - 1:
            return self.surv[i] * (1.0 - self.hazard) ** (k - self.times[i])
        return self.surv[i]

    def partial(self, x: int) -> float:
        """`sum_{k=0}^{x-1} S(k)`."""
        i = self._index(x - 1) if x > 0 else -1
        if i < 0:
            return float(max(x, 0))
        if i == len(self.times) - 1:
            return self.cum[i] + self.surv[i] * self._geometric_sum(x - self.times[i])
        return self.cum[i] + (x - self.times[i]) * self.surv[i]

    def expected_remaining(self, generated: int, limit: int) -> float:
        if limit <= generated:
            return 0.0
        if generated == 0 and (cached := self._by_limit.get(limit)) is not None:
            return cached
        if not self.times or generated >= self.times[-1]:  # past every observation: the constant-rate tail
            value = self._geometric_sum(limit - generated)
        else:
            value = (self.partial(limit) - self.partial(generated)) / self.at(generated)
        if generated == 0:
            self._by_limit[limit] = value
        return value

    def quantile(self, generated: int, limit: int, p: float) -> int:
        """The least `x` in (generated, limit] with `P(L <= x | L > generated) >= p`, else `limit`."""
        if limit <= generated + 1:
            return limit
        times, surv = self.times, self.surv
        if times and generated < times[-1]:
            threshold = (1.0 - p) * self.at(generated)
            for i in range(self._index(generated) + 1, len(times)):
                if surv[i] <= threshold:
                    return min(limit, times[i])
            start, base = times[-1], surv[-1]
        else:
            start, base, threshold = generated, 1.0, 1.0 - p
        # In the tail S(k) = base * (1 - hazard)^(k - start).
        if base <= threshold:
            return min(limit, max(start, generated + 1))
        if self.hazard <= 0.0:
            return limit
        if self.hazard >= 1.0:
            return min(limit, max(start + 1, generated + 1))
        steps = math.ceil(math.log(threshold / base) / math.log(1.0 - self.hazard))
        return min(limit, max(start + steps, generated + 1))


class AnswerLengths:
    """The recent window of finished answers and the conditional expectations built from it.

    Not thread-safe: the admission controller calls it under its own lock. Estimates are rebuilt
    lazily after new observations (O(window log window)), then answered in O(log window).
    """

    def __init__(
        self,
        window: int = WINDOW,
        min_samples: int = MIN_SAMPLES,
        prior_mean: float = PRIOR_MEAN_TOKENS,
        quantile: float = ALLOWANCE_QUANTILE,
    ) -> None:
        if window < 1 or min_samples < 1 or min_samples > window:
            raise ValueError(f"need 1 <= min_samples ({min_samples}) <= window ({window})")
        if not prior_mean >= 1.0:  # inf: answers are assumed to run to their limit (the worst case)
            raise ValueError(f"prior_mean must be a number of tokens >= 1 (or inf), got {prior_mean!r}")
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile!r}")
        self.min_samples, self.prior_mean, self.quantile = min_samples, prior_mean, quantile
        self._window: collections.deque[tuple[int, bool]] = collections.deque(maxlen=window)  # (tokens, stopped)
        self._prior = _Survival([], [], 0.0 if math.isinf(prior_mean) else 1.0 / prior_mean)
        self._running: tuple[int, ...] = ()  # output tokens of the requests still running (censored)
        self._model: _Survival | None = None  # rebuilt after an observation or a change of `_running`

    def observe(self, output_tokens: int, finish_reason: str | None) -> None:
        """Record one finished request. Only "stop" (a natural end) and "length" (censored at its limit) count;
        aborted and failed requests say nothing about answer lengths."""
        if finish_reason not in ("stop", "length") or output_tokens < 1:
            return
        self._window.append((output_tokens, finish_reason == "stop"))
        self._model = None

    def set_running(self, generated: collections.abc.Iterable[int]) -> None:
        """The output tokens of every request still running: each is known to be longer than that so far."""
        running = tuple(sorted(g for g in generated if g > 0))
        if running != self._running:
            self._running = running
            self._model = None

    @property
    def samples(self) -> int:
        """Observations in the window."""
        return len(self._window)

    @property
    def basis(self) -> str:
        """ "observed" once `min_samples` answers have finished, else "prior"."""
        return "observed" if len(self._window) >= self.min_samples else "prior"

    def expected_remaining(self, generated: int, max_tokens: int) -> float:
        """Expected further output tokens of a request that has generated `generated` and not stopped.

        Always in `[min(1, max_tokens - generated), max_tokens - generated]` (0 when at its limit).
        """
        return self._survival().expected_remaining(generated, max_tokens)

    def allowance(self, generated: int, max_tokens: int) -> int:
        """Output tokens to provision: the `quantile` of its length given `generated`; in (generated, max_tokens]."""
        return self._survival().quantile(generated, max_tokens, self.quantile)

    def _survival(self) -> _Survival:
        if len(self._window) < self.min_samples:
            return self._prior
        if self._model is None:
            self._model = self._fit()
        return self._model

    def _fit(self) -> _Survival:
        """Kaplan-Meier over the window and the running requests, plus the constant-rate tail."""
        stops: collections.Counter[int] = collections.Counter()
        ends: collections.Counter[int] = collections.Counter()  # every observation, stopped or censored
        exposure = 0
        for tokens, stopped in self._window:
            ends[tokens] += 1
            exposure += tokens
            if stopped:
                stops[tokens] += 1
        for tokens in self._running:
            ends[tokens] += 1
            exposure += tokens
        at_risk, s = len(self._window) + len(self._running), 1.0
        times, surv = [], []
        for t in sorted(ends):
            if stops[t]:
                s *= 1.0 - stops[t] / at_risk
            times.append(t)
            surv.append(s)
            at_risk -= ends[t]
        return _Survival(times, surv, self._tail_hazard())

    def _tail_hazard(self) -> float:
        """Per-token stop rate past the longest answer seen: that of the longer half of the answers.

        Answer lengths are heavy-tailed (the longer an answer has run, the less likely it is to end at
        the next token), so the rate of the longer half, not of all answers, is what a request that
        outlived them faces. One pseudo-answer of the prior's mean keeps a thin tail from claiming
        certainty: (stops + 1) / (tokens + prior_mean).
        """
        observed = sorted([*self._window, *((g, False) for g in self._running)])
        longer = observed[len(observed) // 2 :]
        stops = sum(stopped for _, stopped in longer)
        tokens = sum(n for n, _ in longer)
        if math.isinf(self.prior_mean):
            return stops / tokens if tokens else 0.0
        return (stops + 1) / (tokens + self.prior_mean)
