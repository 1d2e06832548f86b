"""What admission needs from a prefix cache: measure a request's hit at grant, and let it go at the end.

Admission stays plain Python: the engine passes an object with these methods (`PrefixSharing`), and
admission calls them under its own lock, so a hit is measured and pinned atomically with the
reservation it changes, and blocks a request stops charging become orphans atomically with the
release of its reservation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from helexa.admission.ticket import Ticket


class Share(NamedTuple):
    """A prefix lookup at grant time: `hit_blocks` full blocks of the request are cached, `shared_blocks`
    of them held by running sequences (not reserved again); `pinned`: the hit is now held for it."""

    hit_blocks: int
    shared_blocks: int
    pinned: bool


class BlockStates(NamedTuple):
    """One consistent reading of the pool: `empty + cached + in_use == total`; `retained <= cached`."""

    empty: int
    cached: int
    in_use: int
    retained: int


Decide = Callable[[int, int], bool]  # (hit_blocks, shared_blocks) -> grant now?


class PrefixSharing(Protocol):
    """The prefix cache as admission sees it. Every method is called with admission's lock held."""

    def share(self, ticket: Ticket, decide: Decide) -> Share:
        """Look up the ticket's cached prefix; call `decide(hit, shared)` once; when it says yes, pin the
        hit for the ticket (until `let_go`) before returning."""
        ...

    def let_go(self, ticket: Ticket) -> None:
        """The ticket's reservation ends (finished, cancelled, preempted): drop every cache block it holds
        or has pinned. Blocks charged to it that others still hold become orphans."""
        ...

    def orphan_blocks(self) -> int:
        """In-use blocks charged to no live reservation (their owner ended; sharers remain): reserved."""
        ...

    def block_states(self) -> BlockStates:
        """Empty, cached, in-use and retained blocks, read at one instant."""
        ...
