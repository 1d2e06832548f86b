"""A request's place in admission: queued, then holding a reservation of KV blocks, then ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from helexa.admission.rejections import AdmissionRejected


class TicketState(str, enum.Enum):
    """Where a ticket is in its life. `QUEUED` -> `GRANTED` -> one of the ended states."""

    QUEUED = "queued"  # waiting in the FIFO queue (or, preempted, to resume first); holds nothing
    GRANTED = "granted"  # holds its reservation (blocks + one sequence slot) until released
    RELEASED = "released"  # ended after running: finished, failed or aborted by the engine
    CANCELLED = "cancelled"  # cancelled by the client (while queued, or while granted and then released)
    EXPIRED = "expired"  # waited `max_wait_secs` in the queue; `error` holds the kv_timeout rejection

    @property
    def ended(self) -> bool:
        """True for the states a ticket never leaves."""
        return self in (TicketState.RELEASED, TicketState.CANCELLED, TicketState.EXPIRED)


@dataclass(eq=False)
class Ticket:
    """One admitted (queued or granted) request. The controller owns every field; others read them.

    `max_tokens` is the output limit admission decided (the request's, or the default for a request
    that gave none): the one place it is decided, and where the engine stops the sequence.
    `blocks_reserved` is the reservation: under the `reserve` and `backfill` policies the worst case,
    `ceil((prompt_tokens + max_tokens) / block_size)` less the blocks of its prefix that other requests
    held when it was granted (the KV owner's `shared_blocks`), fixed while it runs; under `adaptive` the
    prompt plus a learned output allowance, grown a whole block at a time (`grow`) and given back when the
    ticket is preempted (`preemptions` counts those); while it waits, what it would reserve now.
    `request_id` is the submitter's id for it: the key the KV owner knows the request by, and what
    rejections name. Which blocks it holds is not recorded here: the KV owner records that. Progress
    fields are set through `AdmissionController.progress`.
    """

    id: int
    prompt_tokens: int
    max_tokens: int
    blocks_reserved: int
    request_id: str | None
    arrival: float  # clock time of submit
    deadline: float  # arrival + max_wait_secs: a queued ticket expires here
    est_wait_at_arrival: float  # seconds, 0.0 when granted at once
    state: TicketState = TicketState.QUEUED
    granted_at: float | None = None
    ended_at: float | None = None
    backfilled: bool = False  # granted ahead of the queue's head under policy "backfill"
    stops_early: bool = True  # False: it ignores EOS with no stop condition, so it runs to max_tokens
    preemptions: int = 0  # times its blocks were taken back to let older requests grow (policy "adaptive")
    tokens_generated: int = 0
    prompt_prefilled: int = 0  # prompt tokens whose K/V is in the cache (shared ones included)
    prompt_loadable: int = 0  # prompt tokens after those that a tier below the pool holds: loaded, not computed
    cancel_requested: bool = False  # cancelled while the engine runs it: the engine must abort, then release
    error: AdmissionRejected | None = None  # set when the ticket expired in the queue
    est_start: float = field(default=0.0, repr=False)  # latest estimated grant time while queued
    seen_by_engine: bool = field(default=False, repr=False)  # returned by a poll

    @property
    def waited_seconds(self) -> float | None:
        """Seconds between submit and grant, or `None` while not granted."""
        return None if self.granted_at is None else self.granted_at - self.arrival

    @property
    def prefill_tokens_left(self) -> int:
        """Prompt tokens still to compute (those a tier will load are not: see `prompt_loadable`)."""
        return max(0, self.prompt_tokens - self.prompt_prefilled - self.prompt_loadable)


class PollResult(NamedTuple):
    """What changed since the engine's last `poll`, each list in the order it happened.

    - `granted`: tickets now holding a reservation; the engine turns each into a running sequence.
    - `expired`: queued tickets that waited `max_wait_secs`; each carries its kv_timeout `error`.
    - `cancelled`: granted tickets the client cancelled while the engine runs them; the engine
      aborts each sequence, frees its blocks, then calls `release` (the reservation is kept until
      then, so no grant can be handed blocks that are still physically in use).
    """

    granted: list[Ticket]
    expired: list[Ticket]
    cancelled: list[Ticket]
