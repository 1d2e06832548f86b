"""Admission test support: a settable clock, a fake engine loop that drives an AdmissionController exactly,
and the from-scratch FIFO oracle.

The fake engine follows the order the real engine loop will: poll (pick up grants, expiries and
cancels), then one decode step of `decode_step_seconds` in which every running sequence finishes
its prefill and gains one token, reported for all of them before the ones that reached their
`max_tokens` are released. With
`prefill_token_seconds=0` the controller's estimates are then exact.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from helexa.admission import AdmissionConfig, AdmissionController, Capacity, EngineRates, FifoPlan, Ticket
from helexa.admission.lengths import AnswerLengths
from helexa.kvprotocol import BlockStates, Share


def controller(
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    *,
    clock: Any = None,
    rates: Any = None,
    wakeup: Any = None,
    kv: Any = None,
    reload_status: Any = None,
    lengths: AnswerLengths | None = None,
    debug: bool | None = None,
    **config: Any,
) -> AdmissionController:
    """An AdmissionController over a pool of `num_blocks` blocks; `config`: `AdmissionConfig` fields.

    `lengths` defaults to the worst-case prior (every answer runs to its `max_tokens`), which is
    exactly what `FakeEngine` does, so estimates made against it are exact.
    """
    kwargs = {"clock": clock} if clock is not None else {}
    return AdmissionController(
        AdmissionConfig(**config),
        Capacity(block_size, num_blocks, max_model_len),
        rates=rates,
        wakeup=wakeup,
        kv=kv,
        reload_status=reload_status,
        lengths=lengths if lengths is not None else AnswerLengths(prior_mean=math.inf),
        debug=debug,
        **kwargs,
    )


class FixedKV:
    """A stand-in KV owner for admission tests (the `KVHoldings` protocol). A request registered with
    `request(prompt_tokens, shared=n, tier=k)` finds `n` full blocks of its prefix cached and held by running
    requests and the next `k` in a tier below the pool (together at most all but its last token's); nothing is
    ever orphaned or cached. `allocate(key, n)` says a request
    now holds `n` blocks of its own, as the engine's table would. Records what it pinned and let go."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size, self.num_blocks = block_size, num_blocks
        self._keys = itertools.count(1)
        self.wanted: dict[str, tuple[int, int, int]] = {}  # key -> (prompt tokens, shared blocks, tier blocks)
        self.pinned: dict[str, int] = {}  # key -> shared blocks pinned
        self.own: dict[str, int] = {}  # key -> blocks of its own, as the test reports them
        self.released: list[str] = []  # keys let go, in order
        self.lookups = 0  # lookup() calls

    def request(self, prompt_tokens: int, shared: int = 0, tier: int = 0) -> str:
        key = f"r{next(self._keys)}"
        self.wanted[key] = (prompt_tokens, shared, tier)
        return key

    def allocate(self, key: str, blocks: int) -> None:
        self.own[key] = blocks

    def lookup(self, key: str) -> Share:
        self.lookups += 1
        prompt, want, tier = self.wanted.get(key, (1, 0, 0))
        limit = (prompt - 1) // self.block_size
        n = min(want, limit)
        return Share(n, n, min(tier, limit - n))

    def pin(self, key: str, share: Share) -> bool:
        self.pinned[key] = share.shared_blocks
        return True

    def let_go(self, key: str) -> None:
        self.own.pop(key, None)
        if self.pinned.pop(key, None) is not None:
            self.released.append(key)

    def shared_blocks(self, key: str) -> int:
        return self.pinned.get(key, 0)

    def charged_blocks(self, key: str) -> int:
        return self.own.get(key, 0)

    def orphan_blocks(self) -> int:
        return 0

    def block_states(self) -> BlockStates:
        in_use = sum(self.own.values()) + sum(self.pinned.values())
        return BlockStates(self.num_blocks - in_use, 0, in_use, 0)


class SeqWork(NamedTuple):
    """A sequence as the oracle sees it: the blocks it holds (or will hold) and the work it has left."""

    blocks: int
    prefill_tokens: int
    decode_tokens: int


def estimate_starts(
    now: float,
    rates: EngineRates,
    blocks_available: int,
    slots_available: int,
    running: Sequence[SeqWork],
    waiting: Sequence[SeqWork],
) -> list[float]:
    """The oracle: each waiting request's estimated start (FIFO), simulated from scratch."""
    releases = [
        (now + rates.run_seconds(w.prefill_tokens, w.decode_tokens), w.blocks, w.decode_tokens) for w in running
    ]
    plan = FifoPlan(now, blocks_available, slots_available, releases)
    return plan.extend(
        (w.blocks, rates.run_seconds(w.prefill_tokens, w.decode_tokens), w.decode_tokens) for w in waiting
    )


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class FakeEngine:
    controller: AdmissionController
    clock: FakeClock
    kv: FixedKV | None = None  # told of the blocks each running request holds
    step_seconds: float = 1.0
    running: list[Ticket] = field(default_factory=list)
    granted_at: dict[int, float] = field(default_factory=dict)  # ticket id -> clock at grant pick-up
    finished: list[Ticket] = field(default_factory=list)
    expired: list[Ticket] = field(default_factory=list)
    stop_early: dict[int, int] = field(default_factory=dict)  # ticket id -> tokens after which it stops
    teach: bool = False  # release with the finish reason ("stop" / "length"), so admission learns the lengths

    def step(self) -> None:
        """One engine iteration: poll, then one decode step for every running sequence."""
        res = self.controller.poll()
        for t in res.granted:
            self.granted_at[t.id] = self.clock.t
            self.running.append(t)
        self.expired.extend(res.expired)
        for t in res.cancelled:
            self._end(t)
        if not self.running:
            return
        self.clock.advance(self.step_seconds)
        for t in self.running:  # report the whole step's progress first, then release what finished
            n = t.tokens_generated + 1
            if self.kv is not None and t.request_id:
                shared = self.kv.shared_blocks(t.request_id)
                self.kv.allocate(t.request_id, self.controller.capacity.blocks_for(t.prompt_tokens + n) - shared)
            self.controller.progress(t, tokens_generated=n, prompt_prefilled=t.prompt_tokens)
        for t in [t for t in self.running if t.tokens_generated >= self.stop_early.get(t.id, t.max_tokens)]:
            self._end(t)

    def _end(self, t: Ticket) -> None:
        self.running.remove(t)
        reason = ("length" if t.tokens_generated >= t.max_tokens else "stop") if self.teach else None
        self.controller.release(t, finish_reason=reason)
        self.finished.append(t)

    def run_until_idle(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.running and not self.controller.queue_depth and not self.controller.in_flight:
                return
            self.step()
        raise AssertionError("fake engine did not drain")
