"""What admission and the KV owner say to each other about blocks, in plain ints keyed by request id.

Admission (`helexa.admission`) reserves blocks; the KV owner (`helexa.kvcache.KVManager`) records who
holds which block. Admission asks through `KVHoldings`, always under its own lock, so a prefix hit is
measured and pinned atomically with the reservation it changes, and blocks a request stops charging
become orphans atomically with the release of its reservation. This module sits below both (no torch),
so each imports it and neither imports the other.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

__all__ = ["BlockStates", "KVHoldings", "Share"]


class Share(NamedTuple):
    """A prefix lookup: `hit_blocks` full blocks of the request's tokens are indexed; `shared_blocks` of them are
    held by running sequences (charged to them: a reservation leaves them out); the rest are cached (evictable),
    and a request that pins them is charged for them. `tier_blocks` full blocks after the hit are held by a
    tier below the pool (host memory, disk): the request will load them into new blocks of its own reservation
    instead of computing them, so they are charged like computed ones and only their time differs."""

    hit_blocks: int
    shared_blocks: int
    tier_blocks: int = 0


class BlockStates(NamedTuple):
    """One consistent reading of the pool: `empty + cached + in_use == total`; `retained <= cached`."""

    empty: int
    cached: int
    in_use: int
    retained: int


class KVHoldings(Protocol):
    """The KV owner as admission sees it; `key` is the request id the engine registered with the owner."""

    def lookup(self, key: str) -> Share:
        """The request's prefix hit now; pins nothing."""
        ...

    def pin(self, key: str, share: Share) -> bool:
        """Pin the hit `lookup` returned for the request (until `let_go`). False, pinning nothing, when the hit
        is no longer exactly `share` (another thread changed the cache since): look up again."""
        ...

    def let_go(self, key: str) -> None:
        """The request's reservation ends (finished, cancelled, preempted): drop every cache block it holds
        outside a block table, and its pins. Blocks charged to it that others still hold become orphans."""
        ...

    def shared_blocks(self, key: str) -> int:
        """Blocks the request holds (or has pinned) that are charged to other requests: 0 before a pin."""
        ...

    def charged_blocks(self, key: str) -> int:
        """Blocks charged to the request: those it holds or has pinned, less the shared ones."""
        ...

    def orphan_blocks(self) -> int:
        """In-use blocks charged to no request (their owner ended; sharers remain): admission reserves them."""
        ...

    def block_states(self) -> BlockStates:
        """Empty, cached, in-use and retained blocks, read at one instant."""
        ...
