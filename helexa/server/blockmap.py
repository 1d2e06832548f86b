"""The operator page's block map: every KV block's state and who holds it, read so that its counts are the
admission snapshot's.

One character per block id (`cells[i]` is block `i`):

- `u` in use: held by a running sequence, or pinned for one about to start.
- `r` reserved, not yet allocated: a live reservation will take it. These are the blocks the next
  allocations take: the top of the free stack, then cached blocks in eviction order (retained ones last).
- `e` empty: on the free stack and promised to nobody.
- `c` cached: full, hashed, held by no sequence; evictable, counted as available.
- `s` retained: cached and kept for an agent session (`prompt_cache_key`); evicted last.

Counts, in every map whose `exact` is True (the pool was read at the same state as `snapshot`):
`u == blocks_in_use`; `r == blocks_reserved - blocks_in_use`; `e + c + s == blocks_available`;
`e == blocks_empty - min(r, blocks_empty)`; `c + s == blocks_cached - max(0, r - blocks_empty)`.
Owners name requests (their ids and sessions) and sessions, never prompt text.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from helexa.engine.view import EngineView

__all__ = ["CELL_STATES", "BlockMap", "expected_counts", "read_block_map", "runs"]

# cell character -> state name (the page's legend order)
CELL_STATES = {"u": "in_use", "r": "reserved", "e": "empty", "c": "cached", "s": "retained"}
_U, _R, _E, _C, _S = b"urecs"


@dataclass(frozen=True)
class BlockMap:
    """One reading of the pool for display.

    `cells`: one character per block id (see the module docstring); `counts`: cells per state name;
    `owners`: `{"kind": "request"|"session", "id", "session", "runs": [start, length, ...]}` — the in-use
    blocks each running request holds (a shared block is listed under every holder), and the retained
    blocks of each agent session; `exact`: the pool was read in the state `snapshot` describes, so
    `counts == expected_counts(snapshot)`.
    """

    cells: str
    counts: dict[str, int]
    owners: list[dict[str, Any]]
    exact: bool

    def as_json(self) -> dict[str, Any]:
        """The map as the data route sends it."""
        return {"cells": self.cells, "counts": self.counts, "owners": self.owners, "exact": self.exact}


def expected_counts(snapshot: dict[str, Any]) -> dict[str, int]:
    """The cells per state a map of the pool in the state `snapshot` (a `GET /v1/admission` body) has."""
    in_use, empty = snapshot["blocks_in_use"], snapshot["blocks_empty"]
    pending = max(0, snapshot["blocks_reserved"] - in_use)
    on_empty = min(pending, empty)
    on_cached = pending - on_empty
    retained = snapshot["blocks_retained"]
    unretained = snapshot["blocks_cached"] - retained
    on_unretained = min(on_cached, unretained)
    return {
        "in_use": in_use,
        "reserved": pending,
        "empty": empty - on_empty,
        "cached": unretained - on_unretained,
        "retained": retained - (on_cached - on_unretained),
    }


def runs(block_ids: Iterable[int] | np.ndarray) -> list[int]:
    """Block ids as sorted runs, flattened: `[start, length, start, length, ...]` (duplicates count once)."""
    ids = np.sort(block_ids if isinstance(block_ids, np.ndarray) else np.fromiter(block_ids, dtype=np.int64))
    if ids.size == 0:
        return []
    ids = ids[np.concatenate(([True], ids[1:] != ids[:-1]))]
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = ids[np.concatenate(([0], breaks))]
    ends = ids[np.concatenate((breaks - 1, [ids.size - 1]))]
    return np.column_stack((starts, ends - starts + 1)).ravel().tolist()


def read_block_map(view: EngineView) -> BlockMap:
    """Every block's state and holders in one `EngineView` (`Engine.view()`): the KV owner's survey, drawn
    against the view's admission snapshot.

    The survey was read in one instant (under the KV owner's lock, with one copy of the free stack: under a
    millisecond for 100,000 blocks); the rest is vectorised (tens of milliseconds for 100,000 blocks,
    outside every lock). When the survey no longer matches the snapshot's block states (the engine moved
    on in between) the map is still a true reading, with `exact` False: the caller reads both again.
    """
    snapshot = view.snapshot
    total = snapshot["blocks_total"]
    pending = max(0, snapshot["blocks_reserved"] - snapshot["blocks_in_use"])
    sessions: dict[Hashable, list[int]] = {}
    cells = np.full(total, _U, dtype=np.uint8)  # (blocks_total,) one state character per block id
    if view.kv is None:  # reloading: no pool to read, only the snapshot's counts (which agree with themselves)
        empty, cached, retained_n = snapshot["blocks_empty"], snapshot["blocks_cached"], snapshot["blocks_retained"]
        cells[:empty] = _E
        cells[empty : empty + cached - retained_n] = _C
        cells[empty + cached - retained_n : empty + cached] = _S
        free = np.arange(empty - 1, -1, -1)  # so that the reserved cells are the first empty ones
        evictable = np.arange(empty, empty + cached)
    else:
        survey = view.kv.cache
        sessions = survey.sessions
        free, evictable = np.asarray(survey.free, dtype=np.int64), np.asarray(survey.evictable, dtype=np.int64)
        cells[free] = _E
        cells[evictable] = _C
        cells[np.asarray(survey.retained, dtype=np.int64)] = _S
    retained = (
        cells == _S
    )  # before the reserved cells are drawn: a retained block a reservation takes keeps its session
    # What the next allocations take, first first: the free stack's top, then cached blocks in eviction order,
    # retained ones last (whether or not their retention ran out, so the counts follow the snapshot's).
    taken = free[::-1][:pending]
    if pending > taken.size:
        by_state = cells[evictable]
        spill = np.concatenate((evictable[by_state == _C], evictable[by_state == _S]))
        taken = np.concatenate((taken, spill[: pending - taken.size]))
    cells[taken] = _R
    tally = np.bincount(cells, minlength=256)
    counts = {name: int(tally[ord(c)]) for c, name in CELL_STATES.items()}
    owners = _owners(view, cells, retained, sessions)
    return BlockMap(cells.tobytes().decode("ascii"), counts, owners, view.consistent)


def _owners(
    view: EngineView, cells: np.ndarray, retained: np.ndarray, sessions: dict[Hashable, list[int]]
) -> list[dict[str, Any]]:
    """Who holds the in-use cells (running requests, and granted ones whose prefix hit is pinned) and which
    session retains the retained ones. `cells`: (blocks,) uint8 states; `retained`: (blocks,) bool."""
    total = cells.size

    def where(ids: Iterable[int], mask: np.ndarray) -> np.ndarray:
        a = np.fromiter(ids, dtype=np.int64)
        a = a[(a >= 0) & (a < total)]
        return a[mask[a]]

    in_use = cells == _U
    owners = []
    for holding in view.kv.holdings if view.kv is not None else []:
        if not holding.block_ids:
            continue
        session = holding.session
        owners.append(
            {
                "kind": "request",
                "id": holding.key,
                "session": session if isinstance(session, str) else None,
                "runs": runs(where(holding.block_ids, in_use)),
            }
        )
    for key, kept in sessions.items():
        mine = where(kept, retained)
        if mine.size:
            owners.append({"kind": "session", "id": str(key), "session": str(key), "runs": runs(mine)})
    return owners
