"""Block-exact admission: two gates, one FIFO queue, deadlines, and Retry-After from live estimates.

Life of a request:

1. `submit(prompt_tokens, max_tokens, request_id=...)`: rejected at once and for good (`kv_unservable`)
   when `ceil((prompt + max_tokens) / block_size)` blocks can never fit this node (sharing never
   counts here); granted at once when nobody waits and both gates pass (sequences in flight <
   `max_num_seqs`, blocks available >= its reservation); rejected when the queue is full (`queue_full`, or
   `model_reloading` while the model reloads) or its *expected* wait already exceeds `max_wait_secs`
   (`kv_timeout`); queued otherwise.
2. The engine's `poll()` each step hands over grants, queued requests that expired (kv_timeout), and
   running ones the client cancelled.
3. While a ticket runs the engine reports `progress(...)`: output tokens, prefilled prompt tokens,
   physical blocks taken from the reservation.
4. At finish, error or abort the engine calls `release(ticket, finish_reason=..., output_tokens=...)`:
   the whole reservation returns, the answer's length is learned, and the queue is served, head first.

Policies: `reserve` (default) reserves the worst case, prompt + `max_tokens`, so a running request
never runs short; `backfill` also lets a request behind a blocked head start when it is expected to
end before the head could start; `adaptive` reserves the prompt plus a learned output allowance,
grows a reservation one whole block at a time (`grow`), and when the pool is short the engine
preempts the most recently admitted request (`preempt`), which waits to resume ahead of the queue.

Accounting: `blocks_available = blocks_total - blocks_reserved`, where `blocks_reserved` is the sum
of live reservations plus the KV owner's orphan blocks (in use by sharers, charged to no live
reservation). Who holds which block is the KV owner's record (`kv`, the `KVHoldings` protocol of
`helexa.kvprotocol`), asked under this lock: a request's prefix hit is looked up and pinned when it is
granted, atomically with its reservation — blocks of its prefix that running requests hold (its
`shared_blocks`) are not reserved again; cached blocks it takes count like new ones. Cached blocks
count as available. Wait estimates use the expected remaining output of each request (lengths.py),
never its worst case.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from helexa.admission import rejections as why
from helexa.admission.estimator import FifoPlan, retry_after_seconds
from helexa.admission.lengths import AnswerLengths
from helexa.admission.rates import EngineRates
from helexa.admission.rejections import REJECTION_REASONS, AdmissionIntegrityError, AdmissionRejected, RecentRejection
from helexa.admission.ticket import PollResult, Ticket, TicketState
from helexa.config import AdmissionConfig
from helexa.kvprotocol import BlockStates, KVHoldings, Share
from helexa.values import check_int, debug_enabled, is_int

logger = logging.getLogger("helexa.admission")


@dataclass(frozen=True)
class Capacity:
    """What the loaded engine can hold: its KV pool's geometry and the longest sequence it accepts."""

    block_size: int
    num_blocks: int
    max_model_len: int

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_model_len"):
            check_int(getattr(self, name), f"Capacity.{name}")

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: `ceil(num_tokens / block_size)`."""
        return -(-num_tokens // self.block_size)


class _Fields:
    """`key=value ...` rendered only when a log record is actually emitted."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.fields.items())


def _seconds(x: float) -> float:
    return round(x, 3)


class _Measured(NamedTuple):
    """A ticket's prefix lookup at a grant attempt, and whether its hit is now pinned (it is granted)."""

    hit_blocks: int
    shared_blocks: int
    pinned: bool


class AdmissionView(NamedTuple):
    """One reading of admission under its lock, for display (`AdmissionController.view`).

    `snapshot` is `snapshot()`'s dict; `waiting` copies of the waiting tickets in the order they will be
    granted (preempted ones first), each with its current `est_start`; `running` copies of the granted
    tickets in admission order; `rejections` the recent rejections, oldest first; `now` the clock's time
    of the reading (the clock `est_start`, `arrival` and `granted_at` are on).
    """

    now: float
    snapshot: dict[str, Any]
    waiting: list[Ticket]
    running: list[Ticket]
    rejections: list[RecentRejection]


class AdmissionController:
    """Admits requests against a fixed pool of KV blocks and a sequence-count limit, FIFO.

    Thread-safe: one lock guards all state and nothing slow runs under it (log records and the
    wake-up run after it is released). `submit` and `cancel` may be called from any thread; `poll`,
    `progress` and `release` belong to the engine's thread.

    - `clock`: monotonic seconds (tests inject a fake); `rates`: the engine's speed until it measures.
    - `wakeup()`: called after `submit`, `cancel` or `release` changed something the engine loop should see.
    - `kv`: the KV owner (`KVHoldings`): prefix hits looked up and pinned at grant, block states,
      orphans, each request's shared and charged blocks. Without one (standalone use) nothing is shared
      and a block counts as in use from the moment it is reserved.
    - `reload_status()`: None while the model serves, else the estimated seconds until it serves again
      (a full queue then answers `model_reloading`).
    - `lengths`: the learned answer lengths estimates are made from (a fresh window by default).
    - `debug`: run `check_integrity()` after every change (default: `HELEXA_DEBUG`).
    - `recent_rejections`: how many rejections `recent_rejections()` keeps (the newest; a bounded ring).
    """

    def __init__(
        self,
        config: AdmissionConfig,
        capacity: Capacity,
        *,
        clock: Callable[[], float] = time.monotonic,
        rates: EngineRates | None = None,
        wakeup: Callable[[], None] | None = None,
        kv: KVHoldings | None = None,
        reload_status: Callable[[], float | None] | None = None,
        lengths: AnswerLengths | None = None,
        debug: bool | None = None,
        recent_rejections: int = 64,
    ) -> None:
        self.config = config
        self.capacity = capacity
        self._clock = clock
        self._rates = rates if rates is not None else EngineRates()
        self._wakeup = wakeup
        self._kv = kv
        self._reload_status: Callable[[], float | None] = reload_status or (lambda: None)
        self._debug = debug_enabled() if debug is None else debug
        self._lengths = lengths if lengths is not None else AnswerLengths()
        self._adaptive = config.policy == "adaptive"

        self._lock = threading.Lock()
        self._queue: collections.OrderedDict[int, Ticket] = collections.OrderedDict()  # FIFO, by ticket id
        # Preempted tickets waiting to resume, oldest first; served before the queue and never expire.
        self._resume: collections.OrderedDict[int, Ticket] = collections.OrderedDict()
        self._running: dict[int, Ticket] = {}  # granted, not yet released
        self._reserved = 0  # sum of blocks_reserved over _running
        self._next_id = 1
        self._new_grants: list[Ticket] = []  # granted since the last poll
        self._new_cancels: list[Ticket] = []  # granted, seen by the engine, then cancelled
        self._effects: list[Callable[[], None]] = []  # log records, written after the lock is released
        self._wake_due = False  # something the engine loop should see changed: call `wakeup` after the lock
        self._critical = _Critical(self)

        # The FIFO simulation behind every wait estimate (see estimator.py).
        self._plan: FifoPlan | None = None
        self._plan_time = 0.0
        self._plan_stale = True  # a grant, release or cancel changed the queue or the reservations
        self._plan_drifted = False  # progress or rates changed; replan after `replan_interval_secs`
        self._backfill_due = False  # policy "backfill": capacity came free; look behind the head at the next poll

        self._rejected = dict.fromkeys(REJECTION_REASONS, 0)
        self._recent: collections.deque[RecentRejection] = collections.deque(
            maxlen=check_int(recent_rejections, "recent_rejections", 0)
        )
        self._admitted_total = 0
        self._admitted_after_wait = 0
        self._wait_seconds_sum = 0.0
        self._preemptions = 0
        self._lengths_time = -float("inf")  # when the running requests' progress last reached `_lengths`

    # ------------------------------------------------------------------ server side

    def submit(
        self,
        prompt_tokens: int,
        max_tokens: int | None = None,
        *,
        stops_early: bool = True,
        request_id: str | None = None,
    ) -> Ticket:
        """Admit a tokenised request: returns its `Ticket` (granted or queued) or raises `AdmissionRejected`.

        `max_tokens=None` means `min(max_model_len - prompt_tokens, default_max_tokens)` output
        tokens. With a prefix cache, the blocks of its prefix that running sequences hold are measured
        when it is granted and not reserved again. `stops_early=False` says the request can only end at its
        limit (it ignores EOS and has no stop condition): its estimates are exact, not learned, and
        its length teaches nothing. `request_id` is the key the KV owner knows the request by (registered
        there first) and what its rejection names. Raises `ValueError` for malformed numbers. A granted ticket also
        appears in the engine's next `poll().granted`.
        """
        check_int(prompt_tokens, "prompt_tokens")
        if max_tokens is not None:
            check_int(max_tokens, "max_tokens")
        with self._critical:
            outcome = self._submit_locked(self._clock(), prompt_tokens, max_tokens, bool(stops_early), request_id)
            self._wake_due = isinstance(outcome, Ticket)
        if isinstance(outcome, AdmissionRejected):
            raise outcome
        return outcome

    def cancel(self, ticket: Ticket) -> bool:
        """Withdraw a request (client gone or cancelled). Idempotent, any thread; True if it changed anything.

        A queued ticket leaves the queue. A granted ticket the engine has not picked up yet is
        released at once. A granted ticket the engine is running is marked `cancel_requested` and
        handed to the engine in `poll().cancelled`; its reservation returns when the engine has
        freed the sequence's blocks and calls `release` — never earlier, so a grant can never be
        given blocks that are still physically in use.
        """
        with self._critical:
            self._check_owned(ticket)
            now = self._clock()
            changed = True
            if ticket.state is TicketState.QUEUED:
                (self._resume if ticket.id in self._resume else self._queue).pop(ticket.id)
                ticket.state, ticket.ended_at = TicketState.CANCELLED, now
                self._plan_stale = True
                self._pump(now)
            elif ticket.state is TicketState.GRANTED and not ticket.cancel_requested:
                ticket.cancel_requested = True
                if ticket.seen_by_engine:
                    self._new_cancels.append(ticket)
                    self._plan_drifted = True
                else:
                    self._end(ticket, now, TicketState.CANCELLED)
                    self._pump(now)
            else:
                changed = False
            self._wake_due = changed
        return changed

    # ------------------------------------------------------------------ engine side

    def poll(self, now: float | None = None) -> PollResult:
        """Expire queued tickets past their deadline, then hand over grants and cancels since the last poll.

        Expired tickets carry `error`: a kv_timeout `AdmissionRejected` whose Retry-After is their
        estimated remaining wait. Lists are in the order events happened (grants in FIFO order).
        """
        with self._critical:
            now = self._clock() if now is None else now
            expired: list[Ticket] = []
            if self._queue and next(iter(self._queue.values())).deadline <= now:
                self._ensure_plan(now)  # every queued ticket's est_start, for Retry-After
                while self._queue:
                    head = next(iter(self._queue.values()))
                    if head.deadline > now:
                        break
                    self._expire(head, now)
                    expired.append(head)
                self._plan_stale = True
                self._pump(now)
            if self._adaptive or self._resume:
                self._pump(now)  # growth and preemption change what is available without a release
            if self._backfill_due:
                self._backfill(now)
            granted, self._new_grants = self._new_grants, []
            for ticket in granted:
                ticket.seen_by_engine = True
            cancelled, self._new_cancels = self._new_cancels, []
        return PollResult(granted, expired, cancelled)

    def progress(
        self,
        ticket: Ticket,
        *,
        tokens_generated: int | None = None,
        prompt_prefilled: int | None = None,
        prompt_loadable: int | None = None,
    ) -> None:
        """Record a running ticket's progress (absolute values, not deltas); `prompt_loadable`: prompt tokens a
        tier below the pool still holds for it to load (0 once its loads are done).

        Raises `ValueError` when a value leaves its bounds: `tokens_generated <= max_tokens`,
        `prompt_prefilled <= prompt_tokens`, `prompt_loadable <= prompt_tokens`. (The blocks it holds are the KV
        owner's to count.)
        """
        with self._critical:
            self._check_progress(ticket, tokens_generated, prompt_prefilled, prompt_loadable)
            if tokens_generated is not None:
                ticket.tokens_generated = tokens_generated
            if prompt_prefilled is not None:
                ticket.prompt_prefilled = prompt_prefilled
            if prompt_loadable is not None:
                ticket.prompt_loadable = prompt_loadable
            self._plan_drifted = True

    def progress_all(self, updates: Iterable[tuple[Ticket, int, int]]) -> None:
        """One engine step's progress of many running tickets, `(ticket, prompt_prefilled, tokens_generated)` each:
        what `progress(ticket, prompt_prefilled=..., tokens_generated=...)` records for each, under one lock. Every
        update is checked before any is recorded: a bad one raises `ValueError` and nothing changes."""
        updates = list(updates)
        granted, running = TicketState.GRANTED, self._running
        with self._critical:
            for ticket, prefilled, generated in updates:
                if not (  # the common case, checked inline; otherwise `_check_progress` says what is wrong
                    isinstance(ticket, Ticket)
                    and running.get(ticket.id) is ticket
                    and ticket.state is granted
                    and type(prefilled) is int
                    and type(generated) is int
                    and 0 <= prefilled <= ticket.prompt_tokens
                    and 0 <= generated <= ticket.max_tokens
                ):
                    self._check_progress(ticket, generated, prefilled, None)
            for ticket, prefilled, generated in updates:
                ticket.prompt_prefilled, ticket.tokens_generated = prefilled, generated
            if updates:
                self._plan_drifted = True

    def _check_progress(
        self, ticket: Ticket, tokens_generated: int | None, prompt_prefilled: int | None, prompt_loadable: int | None
    ) -> None:
        """`progress`'s checks: an owned, granted ticket; each value given an int within its bounds."""
        self._check_owned(ticket)
        if ticket.state is not TicketState.GRANTED:
            raise ValueError(f"progress() for ticket {ticket.id} in state {ticket.state.value}; it must be granted")
        for name, value, limit, what in (
            ("tokens_generated", tokens_generated, ticket.max_tokens, "its max_tokens"),
            ("prompt_prefilled", prompt_prefilled, ticket.prompt_tokens, "the tokens of its prompt"),
            ("prompt_loadable", prompt_loadable, ticket.prompt_tokens, "the tokens of its prompt"),
        ):
            if value is not None and not (is_int(value) and 0 <= value <= limit):
                check_int(value, name, 0)
                raise ValueError(f"ticket {ticket.id}: {name}={value} exceeds {what} ({limit})")

    def release(self, ticket: Ticket, *, finish_reason: str | None = None, output_tokens: int | None = None) -> bool:
        """End a granted ticket's reservation (finish, error, abort): every block returns, the queue is served.

        A `finish_reason` of "stop" or "length" with the answer's `output_tokens` (default: the last
        reported `tokens_generated`) is learned as one answer length. Idempotent: False when the
        ticket had already ended. Raises `ValueError` for a queued ticket (use `cancel`).
        """
        with self._critical:
            self._check_owned(ticket)
            if ticket.state is TicketState.QUEUED:
                raise ValueError(f"release() of queued ticket {ticket.id}; cancel() withdraws a queued request")
            changed = ticket.state is TicketState.GRANTED
            if changed:
                now = self._clock()
                if ticket.stops_early and not ticket.cancel_requested:
                    self._lengths.observe(
                        ticket.tokens_generated if output_tokens is None else output_tokens, finish_reason
                    )
                self._end(ticket, now, TicketState.CANCELLED if ticket.cancel_requested else TicketState.RELEASED)
                self._pump(now)
            self._wake_due = changed
        return changed

    def grow(self, ticket: Ticket, blocks: int) -> bool:
        """Make a running ticket's reservation at least `blocks`, taking whole blocks from those available.

        True when it now is (at once when it already was); False, with nothing changed, when too few
        blocks are available — the engine then preempts the most recently admitted request and asks
        again. Raises `ValueError` beyond the ticket's own bound
        (`ceil((prompt + max_tokens) / block_size)` less its shared blocks) — which is what `reserve` and
        `backfill` reserve up front, so under them a reservation never grows.
        """
        with self._critical:
            self._check_owned(ticket)
            check_int(blocks, "blocks", 0)
            if ticket.state is not TicketState.GRANTED:
                raise ValueError(f"grow() of ticket {ticket.id} in state {ticket.state.value}; it must be granted")
            extra = blocks - ticket.blocks_reserved
            if extra <= 0:
                return True
            bound = self._bound(ticket)
            if blocks > bound:
                raise ValueError(f"ticket {ticket.id}: a reservation of {blocks} blocks exceeds its bound of {bound}")
            if extra > self._available():
                return False
            ticket.blocks_reserved = blocks
            self._reserved += extra
            self._plan_drifted = True
        return True

    def preempt(self, ticket: Ticket) -> None:
        """Take back a running ticket's whole reservation; it waits to resume.

        Policy `adaptive` preempts to let older requests grow; any policy may preempt after a device
        fault when a replay no longer fits. The engine calls this after it has freed the sequence's
        blocks (its stream stays open); the cache blocks it held are let go here. The ticket goes back
        to QUEUED, ahead of every request that has not run yet (preempted tickets resume oldest first
        and never expire), with a new reservation for its prompt, the tokens it has generated
        (recomputed on resume, less what the cache still holds) and, under `adaptive`, a learned
        allowance for the rest. A ticket whose client has cancelled it ends instead. Raises
        `ValueError` unless it is granted and running.
        """
        with self._critical:
            self._check_owned(ticket)
            if ticket.state is not TicketState.GRANTED or not ticket.seen_by_engine:
                raise ValueError(f"preempt() of ticket {ticket.id}: only a granted ticket the engine runs")
            now = self._clock()
            self._preemptions += 1
            if ticket.cancel_requested:
                self._end(ticket, now, TicketState.CANCELLED)
                return
            freed = ticket.blocks_reserved
            del self._running[ticket.id]
            self._reserved -= freed
            self._let_go(ticket)
            ticket.prompt_prefilled = ticket.prompt_loadable = 0
            ticket.blocks_reserved = self._reservation(
                ticket.prompt_tokens, ticket.max_tokens, 0, ticket.tokens_generated, ticket.stops_early
            )
            ticket.state, ticket.preemptions = TicketState.QUEUED, ticket.preemptions + 1
            self._resume[ticket.id] = ticket
            self._resume = collections.OrderedDict(sorted(self._resume.items()))  # oldest (lowest id) first
            self._plan_stale = True
            if logger.isEnabledFor(logging.INFO):
                fields = _Fields(
                    self._ticket_arith(
                        ticket,
                        generated=ticket.tokens_generated,
                        blocks_freed=freed,
                        times_preempted=ticket.preemptions,
                        resume_position=list(self._resume).index(ticket.id) + 1,
                    )
                )
                self._effects.append(lambda: logger.info("admission: preempted ticket=%d %s", ticket.id, fields))

    def refit(self, ticket: Ticket) -> bool:
        """Make a running ticket's reservation cover its bound again after the KV owner stopped sharing blocks
        with it (a device fault dropped the pool: its replay computes them itself). Under `reserve` and
        `backfill` the reservation grows to the bound; under `adaptive` reservations grow step by step
        anyway (`grow`), so nothing changes. True when it now covers it (at once when it already did);
        False, with nothing changed, when too few blocks are available — the engine then preempts the
        most recent request."""
        with self._critical:
            self._check_owned(ticket)
            if ticket.state is not TicketState.GRANTED:
                raise ValueError(f"refit() of ticket {ticket.id} in state {ticket.state.value}; it must be granted")
            if self._adaptive and ticket.stops_early:
                return True
            extra = self._bound(ticket) - ticket.blocks_reserved
            if extra <= 0:
                return True
            if extra > self._available():
                return False
            ticket.blocks_reserved += extra
            self._reserved += extra
            self._plan_drifted = True
        return True

    def reshare(self, ticket: Ticket) -> None:
        """Measure a granted ticket's prefix hit again before its sequence starts: its pins are let go and
        taken anew with its reservation, atomically. Blocks another sequence finished computing since the
        grant are then shared instead of reserved (the engine holds back a request whose prompt a running
        sequence is still prefilling, then calls this, before the sequence starts). What is available
        afterwards is served."""
        with self._critical:
            self._check_owned(ticket)
            if ticket.state is not TicketState.GRANTED:
                raise ValueError(f"reshare() of ticket {ticket.id}: only a granted ticket that has not started")
            if self._kv is None:
                return
            self._reserved -= ticket.blocks_reserved
            self._let_go(ticket)
            # Always fits (the blocks it held are reserved or available), and nothing else changes the cache
            # meanwhile: the engine's thread is the caller.
            self._measure(ticket, lambda hit, shared: True)
            self._reserved += ticket.blocks_reserved
            self._plan_stale = True
            self._pump(self._clock())
            self._wake_due = True

    def queue_status(self, ticket: Ticket) -> tuple[int, float] | None:
        """`(place among the waiting requests from 1, estimated seconds until its grant)` while `ticket`
        waits (preempted ones resume first and count ahead); None once it is granted or ended."""
        with self._lock:
            if ticket.state is not TicketState.QUEUED:
                return None
            now = self._clock()
            self._ensure_plan(now)
            place = [*self._resume, *self._queue].index(ticket.id) + 1
            return place, max(0.0, ticket.est_start - now)

    def next_deadline(self) -> float | None:
        """The clock time at which the next queued ticket expires (when `poll` must run), or None."""
        with self._lock:
            return next(iter(self._queue.values())).deadline if self._queue else None

    def estimate_wait(self, prompt_tokens: int, max_tokens: int | None = None, *, worst_case: bool = False) -> float:
        """Seconds a request of this size would be told to wait if it arrived now (0.0: it starts at once).

        Plans exactly as `submit` does, changing nothing. `worst_case=True` instead plans as if every
        request ran to its `max_tokens` — the bound a reservation guards against, and a poor prediction.
        Raises `ValueError` for a request that can never fit.
        """
        check_int(prompt_tokens, "prompt_tokens")
        cap, cfg = self.capacity, self.config
        m = self.granted_max_tokens(prompt_tokens, max_tokens)
        check_int(m, "max_tokens")
        if cap.blocks_for(prompt_tokens + m) > cap.num_blocks or prompt_tokens + m > cap.max_model_len:
            raise ValueError(f"a request of {prompt_tokens} + {m} tokens can never fit this node")
        with self._lock:
            now = self._clock()
            blocks = self._reservation(prompt_tokens, m, 0, 0, True)
            if (
                not self._queue
                and not self._resume
                and blocks <= self._available()
                and len(self._running) < cfg.max_num_seqs
            ):
                return 0.0
            plan = self._build_plan(now, worst_case=True) if worst_case else self._ensure_plan(now)
            return max(0.0, plan.start_of(blocks) - now)

    def granted_max_tokens(self, prompt_tokens: int, requested: int | None) -> int:
        """The output limit a request is granted: what it `requested`, or for None the node's default,
        `min(max_model_len - prompt_tokens, default_max_tokens)` (at least 1). The one place the default is
        decided; the ticket carries the result (`Ticket.max_tokens`) and the engine stops there."""
        if requested is not None:
            return requested
        return max(1, min(self.capacity.max_model_len - prompt_tokens, self.config.default_max_tokens))

    def set_rates(self, rates: EngineRates) -> None:
        """Replace the engine's measured speed (its recent medians) used by every later estimate."""
        if not isinstance(rates, EngineRates):
            raise ValueError(f"rates must be an EngineRates, got {type(rates).__name__}")
        with self._lock:
            self._rates = rates
            self._plan_drifted = True

    @property
    def rates(self) -> EngineRates:
        """The speed estimates use now."""
        return self._rates

    # ------------------------------------------------------------------ visibility

    @property
    def in_flight(self) -> int:
        """Tickets holding a reservation."""
        return len(self._running)

    @property
    def queue_depth(self) -> int:
        """Tickets waiting: in the queue, and preempted ones waiting to resume."""
        return len(self._queue) + len(self._resume)

    @property
    def lengths(self) -> AnswerLengths:
        """The learned answer lengths the estimates use."""
        return self._lengths

    @property
    def blocks_reserved(self) -> int:
        """Sum of live reservations, plus the prefix cache's orphan blocks."""
        with self._lock:
            return self._reserved + self._orphans()

    @property
    def blocks_available(self) -> int:
        """`blocks_total - blocks_reserved`: what the next grant may reserve (cached blocks included)."""
        with self._lock:
            return self._available()

    def snapshot(self) -> dict[str, Any]:
        """The `GET /v1/admission` numbers: pool, gates, queue, rejections, preemptions, counters, rates, basis.

        `blocks_empty + blocks_cached + blocks_in_use == blocks_total` and `blocks_available ==
        blocks_total - blocks_reserved` in every snapshot: the block states come from one reading of the
        pool (never from progress reported a step ago), under the lock that orders every reservation.
        `blocks_free` (the contract's name) equals `blocks_empty`.
        """
        with self._lock:
            return self._snapshot_locked()

    def view(self) -> AdmissionView:
        """`snapshot()`, the waiting and running tickets (copies, with current estimated starts) and the recent
        rejections, all read under one hold of the lock: the rows always add up to the snapshot's counts."""
        with self._lock:
            now = self._clock()
            if self._queue or self._resume:
                self._ensure_plan(now)
            waiting = [replace(t) for t in (*self._resume.values(), *self._queue.values())]
            running = [replace(t) for t in self._running.values()]
            return AdmissionView(now, self._snapshot_locked(), waiting, running, list(self._recent))

    def recent_rejections(self) -> list[RecentRejection]:
        """The newest rejections (at most `recent_rejections` of them), oldest first."""
        with self._lock:
            return list(self._recent)

    def _snapshot_locked(self) -> dict[str, Any]:
        """`snapshot()`'s dict; the lock is held."""
        cfg, total = self.config, self.capacity.num_blocks
        states = self._block_states()
        orphans = self._orphans()
        lengths = self._lengths
        return {
            "block_size": self.capacity.block_size,
            "blocks_total": total,
            "blocks_empty": states.empty,
            "blocks_cached": states.cached,
            "blocks_in_use": states.in_use,
            "blocks_retained": states.retained,
            "blocks_reserved": self._reserved + orphans,
            "blocks_available": total - self._reserved - orphans,
            "blocks_orphaned": orphans,
            "blocks_free": states.empty,
            "in_flight": len(self._running),
            "max_in_flight": cfg.max_num_seqs,
            "queue_depth": len(self._queue) + len(self._resume),
            "blocks_queued": sum(  # what the waiting tickets would reserve at most: their bounds
                self.capacity.blocks_for(t.prompt_tokens + t.max_tokens)
                for t in (*self._queue.values(), *self._resume.values())
            ),
            "max_queue_depth": cfg.max_queue_depth,
            "max_wait_secs": cfg.max_wait_secs,
            "policy": cfg.policy,
            "rejected": dict(self._rejected),
            "preemptions": self._preemptions,
            "preempted_waiting": len(self._resume),
            "admitted_total": self._admitted_total,
            "admitted_after_wait": self._admitted_after_wait,
            "admission_wait_seconds_sum": _seconds(self._wait_seconds_sum),
            "decode_step_seconds": self._rates.decode_step_seconds,
            "prefill_token_seconds": self._rates.prefill_token_seconds,
            "load_token_seconds": self._rates.load_token_seconds,
            "answer_length_basis": lengths.basis,
            "answer_length_samples": lengths.samples,
            "expected_answer_tokens": round(lengths.expected_remaining(0, cfg.default_max_tokens), 1),
        }

    def check_integrity(self) -> None:
        """Raise `AdmissionIntegrityError` (with the numbers) unless every invariant holds.

        Sum of live reservations (plus orphan blocks) == `blocks_reserved` <= total; each ticket's
        allocated blocks <= its reservation <= its bound, and their sum == the allocated count; in
        flight <= `max_num_seqs`; queue depth <= `max_queue_depth`; every queued or preempted ticket
        is QUEUED and every running one GRANTED, none in two places; preempted tickets wait in admission order.
        """
        with self._lock:
            self._check_integrity_locked()

    # ------------------------------------------------------------------ internals (lock held)

    def _submit_locked(
        self, now: float, prompt: int, max_tokens: int | None, stops_early: bool, request_id: str | None
    ) -> Ticket | AdmissionRejected:
        cfg, cap = self.config, self.capacity
        m = self.granted_max_tokens(prompt, max_tokens)
        bound = cap.blocks_for(prompt + m)
        if prompt >= cap.max_model_len or prompt + m > cap.max_model_len or bound > cap.num_blocks:
            message = why.unservable_message(prompt, m, bound, cap.block_size, cap.num_blocks, cap.max_model_len)
            arith = self._arith(prompt, m, 0, bound, None, max_model_len=cap.max_model_len)
            return self._reject("kv_unservable", arith, None, message, request_id)

        ticket = self._new_ticket(now, prompt, m, stops_early, request_id)
        expected = self._lengths.expected_remaining(0, m) if stops_early else float(m)
        waiting = bool(self._queue or self._resume)
        if not waiting or cfg.policy == "backfill":

            def backfills(hit: int) -> bool:  # a request behind a blocked head must end by the head's start
                run_seconds = self._rates.run_seconds(ticket.prefill_tokens_left, expected, ticket.prompt_loadable)
                return not waiting or self._backfill_fits(now, run_seconds)

            share = self._try_grant(ticket, now, backfills)
            if share is not None and share.pinned:
                self._next_id += 1
                ticket.backfilled = waiting
                self._note_grant(ticket, now, from_queue=False)
                return ticket
        else:
            share = None
        if share is None:  # not looked up yet: what it would reserve, for the plan
            share = self._measure(ticket, lambda hit, shared: False)
        shared, blocks = share.shared_blocks, ticket.blocks_reserved

        depth = len(self._queue)
        if depth >= cfg.max_queue_depth:
            # Retry when the queue will have room again: when everything waiting now has started (the
            # head's start would only free one place, for which every refused client would race).
            plan = self._ensure_plan(now)
            tail = next(reversed(self._queue.values()), None)
            wait = max(0.0, (tail.est_start if tail is not None else plan.start_of(blocks)) - now)
            reload_left = self._reload_status()
            message = why.queue_full_message(depth, cfg.max_queue_depth, len(self._running), wait, reload_left)
            if reload_left is not None:
                arith = self._arith(prompt, m, shared, blocks, wait, reload_left_s=_seconds(reload_left))
                return self._reject("model_reloading", arith, retry_after_seconds(reload_left), message, request_id)
            arith = self._arith(prompt, m, shared, blocks, wait, **self._basis(expected, []))
            return self._reject("queue_full", arith, retry_after_seconds(wait), message, request_id)

        plan = self._ensure_plan(now)
        run_seconds = self._rates.run_seconds(ticket.prefill_tokens_left, expected, ticket.prompt_loadable)
        start, appended = plan.append_if_starts_by(blocks, run_seconds, now + cfg.max_wait_secs, expected)
        wait = max(0.0, start - now)
        if not appended:
            message = why.too_long_message(blocks, wait, cfg.max_wait_secs, self._available(), cap.num_blocks, depth)
            arith = self._arith(prompt, m, shared, blocks, wait, **self._basis(expected, plan.last_waited_on))
            return self._reject("kv_timeout", arith, retry_after_seconds(wait), message, request_id)
        self._next_id += 1
        ticket.est_wait_at_arrival = wait
        ticket.est_start = max(start, now)
        self._queue[ticket.id] = ticket
        if logger.isEnabledFor(logging.DEBUG):
            basis = self._basis(expected, plan.last_waited_on)
            fields = _Fields(self._arith(prompt, m, shared, blocks, wait, queue_position=depth + 1, **basis))
            self._effects.append(lambda: logger.debug("admission: queued ticket=%d %s", ticket.id, fields))
        return ticket

    def _new_ticket(self, now: float, prompt: int, m: int, stops_early: bool, request_id: str | None) -> Ticket:
        """A ticket with the next id (taken only once it is kept: `_next_id` moves on then), reserving its bound."""
        return Ticket(
            id=self._next_id,
            prompt_tokens=prompt,
            max_tokens=m,
            blocks_reserved=self.capacity.blocks_for(prompt + m),
            stops_early=stops_early,
            request_id=request_id,
            arrival=now,
            deadline=now + self.config.max_wait_secs,
            est_wait_at_arrival=0.0,
        )

    def _measure(self, ticket: Ticket, decide: Callable[[int, int], bool]) -> _Measured:
        """Look up the ticket's prefix now and size its reservation and prefilled tokens for it; when
        `decide(hit, shared)` says grant, pin the hit (a lookup the engine's thread outdated is taken again,
        at most three times). Returns the lookup and whether it is pinned."""
        bs = self.capacity.block_size
        for _ in range(3):
            share = self._kv.lookup(ticket.request_id) if self._kv is not None and ticket.request_id else Share(0, 0)
            ticket.prompt_prefilled = min(ticket.prompt_tokens, share.hit_blocks * bs)
            ticket.prompt_loadable = min(ticket.prompt_tokens - ticket.prompt_prefilled, share.tier_blocks * bs)
            ticket.blocks_reserved = self._reservation(
                ticket.prompt_tokens,
                ticket.max_tokens,
                share.shared_blocks,
                ticket.tokens_generated,
                ticket.stops_early,
            )
            if not decide(share.hit_blocks, share.shared_blocks):
                return _Measured(share.hit_blocks, share.shared_blocks, False)
            if self._kv is None or not ticket.request_id or self._kv.pin(ticket.request_id, share):
                return _Measured(share.hit_blocks, share.shared_blocks, True)
        return _Measured(share.hit_blocks, share.shared_blocks, False)

    def _try_grant(self, ticket: Ticket, now: float, also: Callable[[int], bool] | None = None) -> _Measured | None:
        """Measure the ticket's hit and grant it when both gates pass (and `also(hit_blocks)`); the lookup's
        `_Measured` (`pinned`: granted). None, with no lookup, when no seat is free or it could not fit even
        with every full block of its prefix shared (a blocked head costs no lookup per release)."""
        if len(self._running) >= self.config.max_num_seqs:
            return None
        if self._kv is not None:
            shareable = (ticket.prompt_tokens + ticket.tokens_generated - 1) // self.capacity.block_size
            least = self._reservation(
                ticket.prompt_tokens, ticket.max_tokens, shareable, ticket.tokens_generated, ticket.stops_early
            )
            if least > self._available():
                return None

        def decide(hit: int, shared: int) -> bool:
            return ticket.blocks_reserved <= self._available() and (also is None or also(hit))

        share = self._measure(ticket, decide)
        if share.pinned:
            ticket.state, ticket.granted_at = TicketState.GRANTED, now
            self._running[ticket.id] = ticket
            self._reserved += ticket.blocks_reserved
            self._new_grants.append(ticket)
            self._plan_stale = True
        return share

    def _arith(self, prompt: int, m: int, shared: int, blocks: int, wait: float | None, **extra: Any) -> dict[str, Any]:
        """The numbers behind a decision, in log-line order (`est_wait_s`/`deadline_s` when a wait was estimated)."""
        arith: dict[str, Any] = {"prompt": prompt, "max_tokens": m, "shared_blocks": shared, "blocks_needed": blocks}
        arith.update(self._gauges())
        if wait is not None:
            arith["est_wait_s"], arith["deadline_s"] = _seconds(wait), self.config.max_wait_secs
        arith.update(extra)
        return arith

    def _basis(self, expected: float, waited_on: list[tuple[float, int, float]]) -> dict[str, Any]:
        """What a wait estimate stood on: the answer-length basis, this request's expected output, and the
        expected remaining output tokens of the releases it waits for (the first 8)."""
        lengths = self._lengths
        basis: dict[str, Any] = {
            "length_basis": lengths.basis,
            "length_samples": lengths.samples,
            "expected_output": round(expected),
        }
        if waited_on:
            shown = ",".join(str(round(tokens)) for _, _, tokens in waited_on[:8])
            basis["waits_on"] = len(waited_on)
            basis["waits_on_expected_tokens"] = shown + (",..." if len(waited_on) > 8 else "")
        return basis

    def _reservation(self, prompt: int, max_tokens: int, shared: int, generated: int, stops_early: bool) -> int:
        """Blocks a ticket reserves when granted: the bound (prompt + max_tokens) under `reserve`/`backfill`;
        under `adaptive` the prompt, the tokens generated so far and a learned allowance for the rest."""
        if not self._adaptive or not stops_early:
            return self.capacity.blocks_for(prompt + max_tokens) - shared
        allowance = max(generated + 1, self._lengths.allowance(generated, max_tokens))
        return self.capacity.blocks_for(prompt + min(allowance, max_tokens)) - shared

    def _bound(self, ticket: Ticket) -> int:
        """The most blocks a ticket can ever need: prompt + max_tokens, less the shared ones."""
        return self.capacity.blocks_for(ticket.prompt_tokens + ticket.max_tokens) - self._shared(ticket)

    def _shared(self, ticket: Ticket) -> int:
        """Blocks the ticket's request holds that other requests are charged for (the KV owner's count)."""
        return self._kv.shared_blocks(ticket.request_id) if self._kv is not None and ticket.request_id else 0

    def _let_go(self, ticket: Ticket) -> None:
        """The KV owner drops the ticket's cache holds and pins (orphans where sharers remain), atomically."""
        if self._kv is not None and ticket.request_id:
            self._kv.let_go(ticket.request_id)

    def _ticket_arith(self, t: Ticket, **extra: Any) -> dict[str, Any]:
        return self._arith(t.prompt_tokens, t.max_tokens, self._shared(t), t.blocks_reserved, None, **extra)

    def _backfill_fits(self, now: float, run_seconds: float) -> bool:
        """True when a request of `run_seconds` started now is estimated to end by the head's estimated start."""
        self._ensure_plan(now)
        head = next(iter(self._queue.values()))
        return now + run_seconds <= head.est_start

    def _pump(self, now: float) -> None:
        """Grant from the head while both gates pass: preempted tickets first (oldest first), then the queue
        (strict FIFO, exact: no estimate involved; each head's prefix hit is measured as it is tried)."""
        cfg, queue = self.config, self._queue
        for waiting in (self._resume, queue):
            while waiting and len(self._running) < cfg.max_num_seqs:
                head = next(iter(waiting.values()))
                share = self._try_grant(head, now)
                if share is None or not share.pinned:
                    break
                waiting.popitem(last=False)
                self._note_grant(head, now, from_queue=True)
            if waiting:
                break
        # Under "backfill", requests behind a blocked head are considered at the engine's next poll,
        # when the step's progress and releases have all been reported and the estimates are current.
        self._backfill_due = cfg.policy == "backfill" and len(queue) >= 2

    def _backfill(self, now: float) -> None:
        """Grant queued requests behind the head that fit now and are estimated to end by the head's start."""
        self._backfill_due = False
        cfg, queue = self.config, self._queue
        if len(queue) < 2 or len(self._running) >= cfg.max_num_seqs:
            return
        self._ensure_plan(now)
        tickets = iter(queue.values())
        shadow = next(tickets).est_start  # the head's estimated start: a backfill must end by then
        rates, picked = self._rates, []
        for t in list(tickets):
            if len(self._running) >= cfg.max_num_seqs:
                break

            def ends_in_time(hit: int, t: Ticket = t) -> bool:  # `_measure` has set t's prefilled and loadable
                return now + rates.run_seconds(t.prefill_tokens_left, t.max_tokens, t.prompt_loadable) <= shadow

            share = self._try_grant(t, now, ends_in_time)
            if share is not None and share.pinned:
                picked.append(t)
        for t in picked:
            del queue[t.id]
            t.backfilled = True
            self._note_grant(t, now, from_queue=True)

    def _note_grant(self, ticket: Ticket, now: float, from_queue: bool) -> None:
        """Count a grant `_try_grant` made and log it (admitted after a wait, or resumed after preemption)."""
        if ticket.preemptions:  # a preempted ticket resuming: admitted (and counted) once already
            if logger.isEnabledFor(logging.INFO):
                fields = _Fields(self._ticket_arith(ticket, generated=ticket.tokens_generated))
                self._effects.append(lambda: logger.info("admission: resumed ticket=%d %s", ticket.id, fields))
            return
        wait = now - ticket.arrival
        self._admitted_total += 1
        self._wait_seconds_sum += wait
        if not from_queue:
            return
        self._admitted_after_wait += 1
        if logger.isEnabledFor(logging.INFO):
            fields = _Fields(
                self._ticket_arith(
                    ticket,
                    waited_s=_seconds(wait),
                    est_wait_s=_seconds(ticket.est_wait_at_arrival),
                    deadline_s=self.config.max_wait_secs,
                    backfilled=ticket.backfilled,
                )
            )
            self._effects.append(lambda: logger.info("admission: admitted ticket=%d %s", ticket.id, fields))

    def _end(self, ticket: Ticket, now: float, state: TicketState) -> None:
        del self._running[ticket.id]
        self._reserved -= ticket.blocks_reserved
        self._let_go(ticket)
        ticket.state, ticket.ended_at = state, now
        if ticket in self._new_grants:  # granted (or, preempted, regranted) and never picked up
            self._new_grants.remove(ticket)
        self._plan_stale = True

    def _expire(self, ticket: Ticket, now: float) -> None:
        del self._queue[ticket.id]
        left, waited = max(0.0, ticket.est_start - now), now - ticket.arrival
        arith = self._ticket_arith(
            ticket, waited_s=_seconds(waited), est_wait_s=_seconds(left), deadline_s=self.config.max_wait_secs
        )
        ticket.state, ticket.ended_at = TicketState.EXPIRED, now
        message = why.expired_message(
            waited, ticket.blocks_reserved, arith["blocks_available"], self.capacity.num_blocks, left
        )
        ticket.error = self._reject("kv_timeout", arith, retry_after_seconds(left), message, ticket.request_id)

    def _reject(
        self, reason: str, arith: dict[str, Any], retry_after: int | None, message: str, request_id: str | None = None
    ) -> AdmissionRejected:
        if retry_after is not None:
            arith["retry_after_s"] = retry_after
        error = AdmissionRejected(reason, message, retry_after, arith)
        self._rejected[reason] += 1
        self._recent.append(RecentRejection(time.time(), reason, message, retry_after, dict(arith), request_id))
        if logger.isEnabledFor(logging.WARNING):
            fields = _Fields(error.arithmetic)
            self._effects.append(lambda: logger.warning("admission: rejected %s %s", reason, fields))
        return error

    def _orphans(self) -> int:
        return self._kv.orphan_blocks() if self._kv is not None else 0

    def _available(self) -> int:
        """Blocks the next grant may reserve: total less live reservations and orphan blocks."""
        return self.capacity.num_blocks - self._reserved - self._orphans()

    def _block_states(self) -> BlockStates:
        if self._kv is not None:
            return self._kv.block_states()
        return BlockStates(self.capacity.num_blocks - self._reserved, 0, self._reserved, 0)

    def _gauges(self) -> dict[str, Any]:
        total, orphans = self.capacity.num_blocks, self._orphans()
        return {
            "blocks_available": total - self._reserved - orphans,
            "blocks_reserved": self._reserved + orphans,
            "blocks_total": total,
            "in_flight": len(self._running),
            "max_num_seqs": self.config.max_num_seqs,
            "queue_depth": len(self._queue),
        }

    def _ensure_plan(self, now: float) -> FifoPlan:
        """The FIFO simulation, rebuilt when stale (or drifted for longer than the replan interval).

        Sets `est_start` on every queued ticket. O((in_flight + queue) log in_flight) when rebuilt.
        """
        plan = self._plan
        if (
            plan is not None
            and not self._plan_stale
            and not (self._plan_drifted and now - self._plan_time >= self.config.replan_interval_secs)
        ):
            return plan
        plan = self._build_plan(now, worst_case=False)
        self._plan, self._plan_time = plan, now
        self._plan_stale = self._plan_drifted = False
        return plan

    def _build_plan(self, now: float, worst_case: bool) -> FifoPlan:
        """Simulate running and waiting tickets from `now` (expected output, or every `max_tokens` when
        `worst_case`); sets `est_start` on the waiting tickets unless `worst_case`."""
        cfg, rates, lengths = self.config, self._rates, self._lengths
        if now - self._lengths_time >= cfg.replan_interval_secs:  # a refit costs O(window): at most this often
            running = (*self._running.values(), *self._resume.values())
            lengths.set_running(t.tokens_generated for t in running if t.stops_early)
            self._lengths_time = now

        def expect(t: Ticket) -> float:
            if worst_case or not t.stops_early:
                return float(t.max_tokens - t.tokens_generated)
            return lengths.expected_remaining(t.tokens_generated, t.max_tokens)

        releases = []
        for t in self._running.values():
            left = 0.0 if t.cancel_requested else expect(t)
            run = rates.run_seconds(t.prefill_tokens_left, left, t.prompt_loadable)
            releases.append((now + run, t.blocks_reserved, left))
        plan = FifoPlan(now, self._available(), cfg.max_num_seqs - len(self._running), releases)
        waiting = [*self._resume.values(), *self._queue.values()]
        decode, prefill = rates.decode_step_seconds, rates.prefill_token_seconds  # inline: 1,000s of tickets
        load = rates.load_token_seconds if rates.load_token_seconds is not None else prefill
        work = []
        for t in waiting:  # a resumed ticket recomputes its generated tokens too
            left = expect(t)
            recompute = t.prompt_tokens + t.tokens_generated - t.prompt_prefilled - t.prompt_loadable
            work.append((t.blocks_reserved, recompute * prefill + t.prompt_loadable * load + left * decode, left))
        starts = plan.extend(work)
        if not worst_case:
            for t, start in zip(waiting, starts):
                t.est_start = start
        return plan

    def _check_owned(self, ticket: Ticket) -> None:
        if not isinstance(ticket, Ticket):
            raise ValueError(f"expected a Ticket, got {type(ticket).__name__}")
        if self._running.get(ticket.id) is ticket:  # (a running ticket: every step's progress asks)
            return
        owned = any(d.get(ticket.id) is ticket for d in (self._queue, self._resume, self._running))
        if not owned and not ticket.state.ended:
            raise ValueError(f"ticket {ticket.id} does not belong to this controller")

    def _check_integrity_locked(self) -> None:
        cfg, problems = self.config, []
        reserved = sum(t.blocks_reserved for t in self._running.values())
        if reserved != self._reserved:
            problems.append(f"sum of live reservations {reserved} != blocks_reserved {self._reserved}")
        orphans = self._orphans()
        if not 0 <= self._reserved + orphans <= self.capacity.num_blocks:
            problems.append(
                f"blocks_reserved {self._reserved} + orphaned {orphans} "
                f"outside [0, blocks_total={self.capacity.num_blocks}]"
            )
        if len(self._running) > cfg.max_num_seqs:
            problems.append(f"in_flight {len(self._running)} > max_num_seqs {cfg.max_num_seqs}")
        if len(self._queue) > cfg.max_queue_depth:
            problems.append(f"queue_depth {len(self._queue)} > max_queue_depth {cfg.max_queue_depth}")
        for t in self._running.values():
            if t.state is not TicketState.GRANTED:
                problems.append(f"running ticket {t.id} in state {t.state.value}")
            charged = self._kv.charged_blocks(t.request_id) if self._kv is not None and t.request_id else 0
            if charged > t.blocks_reserved:
                problems.append(f"ticket {t.id} is charged {charged} blocks > its reservation {t.blocks_reserved}")
            if t.blocks_reserved > self._bound(t):
                problems.append(f"ticket {t.id} reserves {t.blocks_reserved} > its bound {self._bound(t)}")
            if t.id in self._queue:
                problems.append(f"ticket {t.id} is both queued and running")
        for t in self._queue.values():
            if t.state is not TicketState.QUEUED:
                problems.append(f"queued ticket {t.id} in state {t.state.value}")
        for t in self._resume.values():
            if t.state is not TicketState.QUEUED or not t.preemptions:
                problems.append(f"ticket {t.id} waiting to resume in state {t.state.value}, preempted {t.preemptions}x")
            if t.id in self._queue or t.id in self._running:
                problems.append(f"ticket {t.id} waits to resume and is also queued or running")
        if list(self._resume) != sorted(self._resume):
            problems.append(f"preempted tickets out of admission order: {list(self._resume)}")
        for t in self._new_grants:
            if self._running.get(t.id) is not t:
                problems.append(f"ticket {t.id} awaiting poll is not running")
        if problems:
            raise AdmissionIntegrityError("admission integrity: " + "; ".join(problems))


class _Critical:
    """`with controller._critical:` holds the lock for a change; on a clean exit it checks integrity (debug),
    then, outside the lock, writes the change's log records and wakes the engine if due."""

    __slots__ = ("_c",)

    def __init__(self, controller: AdmissionController) -> None:
        self._c = controller

    def __enter__(self) -> None:
        self._c._lock.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        c = self._c
        try:
            if exc_type is not None:
                return
            if c._debug:
                c._check_integrity_locked()
            effects, c._effects = c._effects, []
            wake, c._wake_due = c._wake_due, False
        finally:
            c._lock.release()
        for effect in effects:
            effect()
        if wake and c._wakeup is not None:
            c._wakeup()
