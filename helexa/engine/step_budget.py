"""How many prompt tokens a step that also decodes may prefill: chunks sized to a step time (`--target-step-secs`).

A prefill chunk of `max_num_batched_tokens` keeps a fast device busy, but on a slow one (a CPU) it
holds every decoding stream for the whole step: 10-20 s for 2,048 tokens. `StepBudget` sizes the
prefill part of a step that runs decodes so the step takes about `target_seconds`, from a
`StepCost`; the engine's is `MeasuredStepCost`, its one model of what a step costs (it also gives
admission the rates its wait estimates use): what the steps it runs measure (decode-only steps,
big prefills, and what each chunk added to a step that decoded), starting from the rates calibrated
at load. A step without decodes keeps the whole budget: no stream is waiting on it.

Chunking never changes what a sequence generates (greedy and seeded outputs are batch invariant),
only when its tokens come."""

from __future__ import annotations

import collections
import logging
import statistics
import sys
import threading
from dataclasses import dataclass
from typing import Protocol

from helexa.admission.rates import EngineRates, RateTracker

logger = logging.getLogger("helexa.engine")

__all__ = ["MeasuredStepCost", "StepBudget", "StepCost", "StepEstimate"]


@dataclass(frozen=True)
class StepEstimate:
    """What a step that decodes costs, as predicted now.

    `decode_seconds`: the step with its decode rows alone; `per_token`: what each prompt token adds
    to it (the chunk's own overheads included); `full_rate`: seconds per prompt token of a full chunk,
    where a step's fixed costs are small beside its tokens; `verify_row`: what each speculative draft
    row a decoding sequence verifies adds to a step, as measured on the steps that verified drafts
    (None before any: a prompt token's cost, `per_token`, stands in for it). A draft row attends over
    its whole context, so at long context it costs far more than a prompt token of a short chunk.
    """

    decode_seconds: float
    per_token: float
    full_rate: float
    verify_row: float | None = None

    @property
    def row_seconds(self) -> float:
        """What one more verified draft row costs a step now: `verify_row`, else `per_token`."""
        return self.per_token if self.verify_row is None else self.verify_row


class StepCost(Protocol):
    """The cost model a `StepBudget` sizes chunks with."""

    def estimate(self) -> StepEstimate:
        """The cost of a step that decodes, predicted now."""
        ...

    def observe(
        self, seconds: float, num_decode: int, num_prefill: int, decode_yield: float = 1.0, draft_rows: int = 0
    ) -> None:
        """One step ran `num_decode` decode and `num_prefill` prompt tokens in `seconds` (the loop's cadence);
        each decoding sequence gained `decode_yield` tokens on average (speculative drafts kept: above 1);
        `draft_rows` of the decode tokens were draft tokens verified (beyond each sequence's own)."""
        ...


class MeasuredStepCost:
    """Step costs measured on the steps the engine runs; a stalled step only ever raises a sample, and every
    estimate is a median or a minimum, so one stall does not shrink the chunks that follow.

    - `decode_seconds`: the median of the last `recent` steps that only decoded (before any, the
      rates' decode step: `RateTracker`, calibrated at load), but no more than the latest of them nor
      the fastest of the last `recent` steps that both decoded and prefilled: the device may have sped
      up since (a CPU that other processes stopped sharing), and during a long prefill only the
      budget's probes decode alone.
    - `per_token`: the median, over the last `recent` steps that both decoded and prefilled, of (step
      seconds - `decode_seconds`) / prompt tokens: what a chunk really added, its own overheads (and, as
      a long prompt's context grows, its attention) included; at least `full_rate` / 4. Before any such
      step: `full_rate`.
    - `full_rate`: the median seconds per token of the last `window` prefills of `big_prefill` tokens
      or more that ran without decodes (before any, the rates' prefill cost per token calibrated at
      load), but no more than `per_token`: a full chunk never costs more per token than a small one.
    - `verify_row`: the median, over the last `recent` steps that only decoded and verified draft rows,
      of (step seconds - `decode_seconds`) / draft rows, at least `full_rate` / 4. Those steps are not
      decode steps' samples: a step that verifies drafts costs more than decoding alone.

    Sizing the next chunk as `(target - decode_seconds) / per_token` then scales the last chunk by
    `(target - D) / (measured - D)`: where a chunk costs `P + n c` on top of the decodes, it approaches
    the chunk that meets the target from the side it starts on, without oscillating, as long as the
    target can be met at all (`P` below `target - D`).

    (The `RateTracker` alone cannot size chunks: it splits a mixed step between its decodes and its
    prompt tokens in proportion to their current estimates, so it never learns what a chunk adds.)
    Thread-safe: the engine's thread observes, a snapshot may estimate from any thread.
    """

    def __init__(
        self, rates: RateTracker | None = None, *, window: int = 16, recent: int = 3, big_prefill: int = 256
    ) -> None:
        self.tracker = rates if rates is not None else RateTracker()  # admission's medians, from the same steps
        self.big_prefill = big_prefill
        self._calibrated = max(self.tracker.prefill_token_seconds, 1e-9)  # read once: at load, the calibrated cost
        self._decode: collections.deque[float] = collections.deque(maxlen=recent)  # decode-only step seconds
        self._full: collections.deque[float] = collections.deque(maxlen=window)  # seconds per token, big prefills
        self._added: collections.deque[float] = collections.deque(maxlen=recent)  # seconds per token, mixed steps
        self._mixed: collections.deque[float] = collections.deque(maxlen=recent)  # seconds of mixed steps
        self._verify: collections.deque[float] = collections.deque(maxlen=recent)  # seconds per draft row verified
        self._lock = threading.Lock()

    @classmethod
    def calibrated(cls, decode_step_seconds: float, prefill_token_seconds: float) -> MeasuredStepCost:
        """A cost model starting from costs measured at load (`ModelRunner.calibrate`), not from the priors."""
        return cls(RateTracker.calibrated(decode_step_seconds, prefill_token_seconds))

    def rates(self) -> EngineRates:
        """What admission's wait estimates use now: the median decode step and prompt-token costs."""
        return self.tracker.rates()

    def estimate(self) -> StepEstimate:
        with self._lock:
            return self._estimate()

    def _estimate(self) -> StepEstimate:
        decode = (
            min(statistics.median(self._decode), self._decode[-1]) if self._decode else self.tracker.decode_step_seconds
        )
        if self._mixed:
            decode = min(decode, min(self._mixed))
        full = statistics.median(self._full) if self._full else self._calibrated
        added = max(statistics.median(self._added), full / 4) if self._added else full
        verify = max(statistics.median(self._verify), full / 4) if self._verify else None
        return StepEstimate(decode, added, min(full, added), verify)

    def observe(
        self, seconds: float, num_decode: int, num_prefill: int, decode_yield: float = 1.0, draft_rows: int = 0
    ) -> None:
        if seconds <= 0 or (num_decode <= 0 and num_prefill <= 0):
            return
        self.tracker.observe_step(seconds, num_decode, num_prefill, decode_yield)
        with self._lock:
            if num_prefill <= 0 and draft_rows > 0:
                self._verify.append((seconds - self._estimate().decode_seconds) / draft_rows)
            elif num_prefill <= 0:
                self._decode.append(seconds)
            elif num_decode <= 0:
                if num_prefill >= self.big_prefill:
                    self._full.append(seconds / num_prefill)
            else:
                self._added.append((seconds - self._estimate().decode_seconds) / num_prefill)
                self._mixed.append(seconds)


class StepBudget:
    """The prompt tokens each step may run, given the decode rows it has already scheduled.

    Without decodes, or with `target_seconds` 0 (off): `max_num_batched_tokens`. Otherwise the most
    prompt tokens that keep the predicted step within `target_seconds`, but never fewer than one KV
    block's worth, nor fewer than the tokens a full chunk runs in the time of the decodes alone:
    where the target cannot be met (decoding by itself takes about as long, or longer), prefill
    still gets about half of each step, so a long prompt prefills at least about half as fast as
    alone. At most `max_num_batched_tokens`; the scheduler still gives decodes their tokens first.
    (Chunks are not rounded to whole blocks: a block is offered to the prefix cache the step it
    fills, wherever a chunk ends, and rounding down would waste up to a block of a small budget.)

    After `probe_every` steps in a row that both decoded and prefilled, one step only decodes (limit
    0): a long prefill would otherwise leave the cost of the decodes alone unmeasured for its whole
    length (a probe costs the prefill one step in `probe_every`, and gives the streams a short one).
    """

    def __init__(
        self, max_num_batched_tokens: int, target_seconds: float, block_size: int, cost: StepCost, probe_every: int = 16
    ) -> None:
        if target_seconds < 0:
            raise ValueError(f"target_seconds must be >= 0, got {target_seconds!r}")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.target_seconds = target_seconds
        self.block_size = block_size
        self.cost = cost
        self.probe_every = probe_every
        self._mixed_in_a_row = 0  # steps since the last one that only decoded
        self._logged: int | None = None

    @property
    def enabled(self) -> bool:
        return self.target_seconds > 0

    def prefill_limit(self, num_decode: int) -> int:
        """Most prompt tokens a step with `num_decode` decode rows may prefill (the scheduler's `prefill_limit`);
        logged at debug level when it moves by more than a tenth."""
        if num_decode <= 0 or not self.enabled:
            return self.max_num_batched_tokens
        if self._mixed_in_a_row >= self.probe_every:
            return 0
        est = self.cost.estimate()
        limit = self._limit(est)
        if self._logged is None or abs(limit - self._logged) * 10 > self._logged:
            logger.debug(
                f"engine: prefill chunk budget {limit} tokens (target {self.target_seconds:.3g}s: decode step "
                f"{est.decode_seconds * 1e3:.1f}ms + {est.per_token * 1e3:.2f}ms/token; full chunks "
                f"{est.full_rate * 1e3:.2f}ms/token)"
            )
            self._logged = limit
        return limit

    def load_limit(self, num_decode: int, block_seconds: float | None) -> int:
        """Most KV blocks a step with `num_decode` decode rows may load from a tier below the pool, sized like a
        prefill chunk: the reads (`block_seconds` each, as measured) that keep the step within the target, but
        never less than the decodes alone take, nor less than one block. Before a read was measured, a prefill
        chunk's tokens' worth; without decodes or a target, no limit (`sys.maxsize`): no one waits on it."""
        if num_decode <= 0 or not self.enabled:
            return sys.maxsize
        if block_seconds is None or block_seconds <= 0:
            return max(1, self.chunk_tokens // self.block_size)
        decode = self.cost.estimate().decode_seconds
        return max(1, int(max(self.target_seconds - decode, decode) / block_seconds))

    @property
    def chunk_tokens(self) -> int:
        """What a prefill chunk may be now while requests decode (`max_num_batched_tokens` when off)."""
        return self._limit(self.cost.estimate()) if self.enabled else self.max_num_batched_tokens

    def observe(
        self, seconds: float, num_decode: int, num_prefill: int, decode_yield: float = 1.0, draft_rows: int = 0
    ) -> None:
        """One finished step's cadence, for the cost model to learn from (`decode_yield`, `draft_rows`: see
        `StepCost.observe`)."""
        if num_decode > 0:
            self._mixed_in_a_row = self._mixed_in_a_row + 1 if num_prefill > 0 else 0
        self.cost.observe(seconds, num_decode, num_prefill, decode_yield, draft_rows)

    def _limit(self, est: StepEstimate) -> int:
        full = self.max_num_batched_tokens
        fits = (self.target_seconds - est.decode_seconds) / est.per_token if est.per_token > 0 else full
        # The floor: as many tokens as a full chunk runs in the time of the decodes alone.
        fair = est.decode_seconds / est.full_rate if est.full_rate > 0 else full
        tokens = int(min(float(full), max(fits, fair)))
        return min(full, max(self.block_size, tokens))
