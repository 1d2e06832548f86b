"""The engine's side of the prefix cache: admission pins a request's hit through it at grant; the engine
attaches the hit to the sequence's block table, offers each block the sequence fills, and lets go.

`CacheSharing` implements admission's `PrefixSharing` over the runner's `PrefixCache` (rebuilt, empty,
on every reload: entries of an older cache are stale and never touched again).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from helexa.admission import BlockStates, Share, Ticket
from helexa.engine.sequence import Request, Sequence
from helexa.kvcache import BatchBuilder, PrefixCache, PrefixHit


class CacheSharing:
    """Pins, holds and releases prefix-cache blocks per ticket.

    `cache_of()` is the live runner's cache (None while reloading); `tokens_of(ticket)` the tokens a
    ticket's lookup covers (its prompt, or prompt + output for a preempted request resuming);
    `total_blocks` the pool's size. Admission calls `share`, `let_go`, `orphan_blocks` and
    `block_states` under its lock (any thread); the engine thread calls the rest. Guarantees: the
    blocks `held(ticket)` names are exactly those the ticket holds through the current cache, each
    once, and every one is let go when its reservation ends.
    """

    def __init__(
        self, cache_of: Callable[[], PrefixCache | None], tokens_of: Callable[[Ticket], list[int]], total_blocks: int
    ) -> None:
        self._cache_of, self._tokens_of, self._total = cache_of, tokens_of, total_blocks
        self._held: dict[int, tuple[PrefixCache, list[int]]] = {}  # ticket id -> (cache, blocks held through it)
        self._hits: dict[int, PrefixHit] = {}  # pinned at grant, not yet attached by the engine
        self._lock = threading.Lock()  # guards the two dicts (admission's and the engine's threads)

    # ------------------------------------------------------------------ admission (under its lock)

    def share(self, ticket: Ticket, decide: Callable[[int, int], bool]) -> Share:
        """Look up the ticket's prefix; pin it when `decide(hit, shared)` grants it."""
        cache, req = self._cache_of(), ticket.payload
        if cache is None or not isinstance(req, Request):
            return Share(0, 0, decide(0, 0))
        seen = (0, 0)

        def record(hit: int, shared: int) -> bool:
            nonlocal seen
            seen = (hit, shared)
            return decide(hit, shared)

        hit = cache.acquire(self._tokens_of(ticket), ticket.id, salt=req.cache_salt, decide=record, session=req.session)
        if hit is None:
            return Share(seen[0], seen[1], False)
        with self._lock:
            self._hits[ticket.id] = hit
            self._held[ticket.id] = (cache, list(hit.block_ids))
        return Share(len(hit.block_ids), hit.shared, True)

    def let_go(self, ticket: Ticket) -> None:
        """Release every block the ticket holds or has pinned (its reservation is ending)."""
        with self._lock:
            self._hits.pop(ticket.id, None)
            entry = self._held.pop(ticket.id, None)
        cache = self._cache_of()
        if entry is None or entry[0] is not cache or not entry[1] or cache is None:
            return
        session = ticket.payload.session if isinstance(ticket.payload, Request) else None
        cache.release(entry[1], ticket.id, session=session)

    def orphan_blocks(self) -> int:
        cache = self._cache_of()
        return cache.orphan_blocks if cache is not None else 0

    def block_states(self) -> BlockStates:
        cache = self._cache_of()
        if cache is None:  # reloading: the old pool is gone, the new one not yet allocated
            return BlockStates(self._total, 0, 0, 0)
        return BlockStates(*cache.counts())

    # ------------------------------------------------------------------ engine thread

    def attach(self, ticket: Ticket) -> PrefixHit | None:
        """The hit pinned for a granted ticket, taken over by its new sequence (None: no hit, or a stale one)."""
        with self._lock:
            hit = self._hits.pop(ticket.id, None)
            entry = self._held.get(ticket.id)
        if hit is None or entry is None or entry[0] is not self._cache_of():
            return None
        return hit

    def offer(self, seq: Sequence, builder: BatchBuilder) -> None:
        """Offer the sequence's newly filled, computed blocks to the cache, in order; a block the cache
        indexes is held through it from then on."""
        cache = self._cache_of()
        full = seq.num_computed // builder.pool.block_size
        if cache is None or not seq.offering or seq.blocks_offered >= full:
            return
        tid, bs = seq.ticket.id, builder.pool.block_size
        with self._lock:
            entry = self._held.get(tid)
            if entry is None or entry[0] is not cache:
                entry = self._held[tid] = (cache, [])
        ids = seq.table.block_ids
        for i in range(seq.blocks_offered, full):
            node = cache.insert(
                ids[i], seq.token_ids[i * bs : (i + 1) * bs], seq.prefix_parent, tid, salt=seq.cache_salt
            )
            if node is None:  # a hash collision with other content: this sequence indexes nothing more
                seq.offering = False
                return
            if node.block_id == ids[i]:
                builder.hand_over(seq.table, ids[i])
                entry[1].append(ids[i])
            seq.prefix_parent, seq.blocks_offered = node, i + 1

    def held(self, ticket: Ticket) -> list[int]:
        """The blocks the ticket holds (or has pinned) through the current cache."""
        with self._lock:
            entry = self._held.get(ticket.id)
        return list(entry[1]) if entry is not None and entry[0] is self._cache_of() else []

    def pinned_unattached(self) -> dict[int, PrefixHit]:
        """Hits pinned at grant that no sequence has taken yet, by ticket id."""
        with self._lock:
            return dict(self._hits)

    def reset(self) -> None:
        """Forget every pin and hold (the cache they were in is gone: a reload)."""
        with self._lock:
            self._hits.clear()
            self._held.clear()
