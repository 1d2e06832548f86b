"""Where a pool's blocks are, read at one instant: `CacheSurvey` (the prefix cache's), `HoldingView` and
`KVSurvey` (the KV owner's). Plain values, no torch: the server's side of an engine core reads them."""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

__all__ = ["CacheSurvey", "HoldingView", "KVSurvey"]


class CacheSurvey(NamedTuple):
    """Where every block of the pool is, read at one instant under the cache's lock (`PrefixCache.survey`).

    `free`: the allocator's free stack (the last id is handed out first); `evictable`: the cached
    blocks in the order `ensure_free` would evict them now; `retained`: the cached blocks an agent session
    retains; `sessions`: each session's retained block ids (some may be in use again). `len(free)`,
    `len(evictable)` and `len(retained)` are `counts()`' empty, cached and retained; every other block is in use.
    """

    free: list[int]
    evictable: list[int]
    retained: list[int]
    sessions: dict[Hashable, list[int]]


class HoldingView(NamedTuple):
    """One request's blocks for display: `block_ids` in position order (its table, or its pinned hit)."""

    key: str
    session: Hashable | None
    block_ids: tuple[int, ...]
    charged: int
    running: bool


class KVSurvey(NamedTuple):
    """Where every block is, read at one instant: the index's `cache` survey (free, evictable, retained,
    sessions) and every holding's blocks, in registration order."""

    cache: CacheSurvey
    holdings: list[HoldingView]
