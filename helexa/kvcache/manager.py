"""The KV owner: one object that records who holds which block of the pool, and nothing else does.

    kv = KVManager(pool, max_num_seqs=8, max_model_len=4096, prefix_cache=True)
    kv.open("req-1", prompt_ids, salt=None, session="agent-7")  # the engine registers a request
    share = kv.lookup("req-1"); kv.pin("req-1", share)           # admission, at grant (under its lock)
    computed = kv.start("req-1", seq.token_ids)                  # the engine: its table starts with the hit
    attn = kv.build_step([("req-1", 12)])                        # evict cached blocks if short, grow tables
    kv.offer("req-1", computed + 12)                             # index the blocks the step filled
    kv.drop_table("req-1")                                       # the sequence ends: its own blocks are free
    kv.let_go("req-1")                                           # admission, releasing the reservation
    kv.close("req-1")                                            # the request is gone

A *holding* is everything one request (by its id, the `key`) holds: its block table once it runs, or
the prefix hit pinned for it at grant before that. Every block of the pool is in exactly one of three
states, and the manager is where each is decided:

- **empty**: on the allocator's free stack;
- **cached**: full, indexed by the prefix cache (`PrefixCache`) by the chained hash of its tokens,
  held by no request: evictable, LRU with session retention;
- **in use**: in a holding. A block the request computed is its own (one allocator reference) until it
  is full and offered to the index, which then takes that reference over; from then on the request
  holds it *through the index* (the index counts holders), as it holds blocks its hit took from the
  index. Each in-use block is *charged* to exactly one request (the one that computed it or took it
  from the cached set) or is an *orphan* (its charged request ended while others still hold it).

`block_states()`, `orphan_blocks()`, `shared_blocks(key)` and `charged_blocks(key)` are what admission
reserves against (the `KVHoldings` protocol of `helexa.kvprotocol`): a reservation covers the
blocks charged to its request, and orphans are reserved on the sharers' behalf.

Thread-safety: one re-entrant lock guards every holding and the index. Admission calls `lookup`,
`pin`, `let_go` and the counts with its own lock held (any thread); the engine's thread calls the
rest, never with admission's lock held by itself — so the order is always admission, then the KV.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from helexa.kvcache.batch import BatchBuilder, BlockTable
from helexa.kvcache.metadata import AttentionMetadata
from helexa.kvcache.pool import BlockPool
from helexa.kvcache.prefix import CachedBlock, PrefixCache, root_hash
from helexa.kvcache.survey import CacheSurvey, HoldingView, KVSurvey
from helexa.kvcache.tiers import KVTiers
from helexa.kvprotocol import BlockStates, Share

__all__ = ["HoldingView", "KVManager", "KVSurvey"]


@dataclass(eq=False)
class _Holding:
    """One request's KV: its lookup key (tokens, salt, session) and the blocks it holds."""

    key: str
    tokens: list[int]  # what its prefix lookups cover and its offers read (the running sequence's own list)
    salt: str | None
    session: Hashable | None
    pinned: list[int] = field(default_factory=list)  # held through the index outside a table (a hit, not started)
    shared: int = 0  # of its blocks, how many were held by other requests when it pinned them
    parent: CachedBlock | None = None  # the index entry of its last full block in the chain
    offered: int = 0  # leading full blocks offered to the index (hit ones included)
    offering: bool = True  # False after a hash collision: its later blocks are not indexed
    table: BlockTable | None = None  # while it runs

    def num_blocks(self) -> int:
        return self.table.num_blocks if self.table is not None else len(self.pinned)


class KVManager:
    """Owns the pool, every block table, the prefix cache and every holding and pin (see the module docstring).

    Guarantees (checked by `check_integrity`): every in-use block is charged to exactly one holding or is an
    orphan; `charged_blocks` summed over the holdings plus `orphan_blocks()` equals the in-use count; a
    table lists its own blocks with one allocator reference each and its indexed ones through the index;
    `release`d blocks return to the pool or the cached set and nothing leaks. `reset` swaps the pool
    (a reload) and forgets every block held in the old one, keeping the registrations.
    """

    def __init__(
        self,
        pool: BlockPool | None,
        *,
        max_num_seqs: int,
        max_model_len: int,
        prefix_cache: bool = True,
        retention_secs: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        tiers: KVTiers | None = None,
    ) -> None:
        if tiers is not None and not prefix_cache:
            raise ValueError("KV tiers sit behind the prefix cache: they need prefix_cache=True")
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self._tiers = tiers
        self.prefix_caching = prefix_cache
        self.retention_secs = retention_secs
        self._clock = clock
        self._lock = threading.RLock()
        self._holdings: dict[str, _Holding] = {}
        self._pool: BlockPool | None = None
        self._builder: BatchBuilder | None = None
        self._cache: PrefixCache | None = None
        self._evictions_before = 0  # evictions by the indexes of pools a reset dropped
        self._total = pool.num_blocks if pool is not None else 0
        self.reset(pool)

    # ------------------------------------------------------------------ the pool

    def reset(self, pool: BlockPool | None) -> None:
        """Serve from `pool` (None: no pool, while a model reloads), with an empty index and no block held.

        Every holding keeps its registration (key, tokens, salt, session) and loses its blocks, pins and
        chain: the request starts again from nothing (`start` then gives it an empty table)."""
        with self._lock:
            if self._cache is not None:
                self._evictions_before += self._cache.evictions
            self._pool = pool
            self._builder = BatchBuilder(pool, self.max_num_seqs, self.max_model_len) if pool is not None else None
            self._cache = None
            if pool is not None:
                self._total = pool.num_blocks
                if self.prefix_caching:
                    self._cache = PrefixCache(
                        pool.allocator,
                        pool.block_size,
                        retention_secs=self.retention_secs,
                        clock=self._clock,
                        on_evict=self._spill if self._tiers is not None else None,
                    )
            for h in self._holdings.values():
                h.pinned, h.shared, h.parent, h.offered, h.offering, h.table = [], 0, None, 0, True, None

    @property
    def pool(self) -> BlockPool:
        """The pool served now; `RuntimeError` while there is none (a reload)."""
        if self._pool is None:
            raise RuntimeError("no KV pool is loaded (the model is reloading)")
        return self._pool

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix index of the pool served now (None: prefix caching off, or no pool). For listeners
        (`helexa.cluster`) and research reads; every holding changes through this manager only."""
        return self._cache

    @property
    def tiers(self) -> KVTiers | None:
        """The host-memory and disk tiers below the pool (None: off). Which tier holds which block is theirs to
        record; which pool block holds what stays this manager's."""
        return self._tiers

    def clear_cache(self) -> int:
        """Evict every cached block of the pool (nothing spills) and drop every tier's blocks; returns how many pool
        blocks were evicted. Held blocks stay."""
        with self._lock:
            evicted = self._cache.clear() if self._cache is not None else 0
            if self._tiers is not None:
                self._tiers.clear()
            return evicted

    @property
    def evictions(self) -> int:
        """Cached blocks evicted to make room since start, over every pool served."""
        cache = self._cache
        return self._evictions_before + (cache.evictions if cache is not None else 0)

    # ------------------------------------------------------------------ registration (any thread)

    def open(self, key: str, tokens: list[int], *, salt: str | None = None, session: Hashable | None = None) -> None:
        """Register a request by `key` before admission looks it up: `tokens` (its prompt) are what lookups
        cover; the index shares blocks only between requests of the same `salt`; `session` (an agent's
        prompt_cache_key) retains its blocks when it ends. Raises `ValueError` for a key in use."""
        with self._lock:
            if key in self._holdings:
                raise ValueError(f"request {key!r} is already registered with the KV manager")
            self._holdings[key] = _Holding(key, tokens, salt, session)

    def close(self, key: str) -> None:
        """Forget a request that holds nothing any more (idempotent). Raises `ValueError` while it still holds
        a table or pins (drop and let go first)."""
        with self._lock:
            h = self._holdings.get(key)
            if h is None:
                return
            if h.table is not None or h.pinned:
                raise ValueError(f"request {key!r} still holds {h.num_blocks()} blocks; drop_table and let_go first")
            del self._holdings[key]

    def keys(self) -> list[str]:
        """The registered requests, in registration order."""
        with self._lock:
            return list(self._holdings)

    # ------------------------------------------------------------------ admission (its lock held)

    def lookup(self, key: str) -> Share:
        """The request's prefix hit now (pins nothing): at most `(len(tokens) - 1) // block_size` blocks, so
        at least its last token is computed; and the blocks after it that a tier below the pool holds (within
        the same limit), which it would load rather than compute. Reads no tier's data."""
        with self._lock:
            h, cache = self._holdings[key], self._cache
            if cache is None:
                return Share(0, 0)
            limit = self._limit(h, cache)
            nodes = cache.match(h.tokens, h.salt, limit)
            below = 0
            if self._tiers is not None and len(nodes) < limit:
                parent = nodes[-1].hash if nodes else root_hash(h.salt)
                below = self._tiers.peek(h.tokens, len(nodes), parent, limit)
            return Share(len(nodes), sum(1 for n in nodes if cache.holders(n.block_id) > 0), below)

    def pin(self, key: str, share: Share) -> bool:
        """Pin the request's hit when it is still exactly `share` (False, pinning nothing, otherwise)."""
        with self._lock:
            h, cache = self._holdings[key], self._cache
            if h.pinned or h.table is not None:
                raise ValueError(f"request {key!r} already holds blocks; let_go before pinning again")
            if cache is None:
                return share.hit_blocks == share.shared_blocks == 0
            if share.hit_blocks == 0:
                return share.shared_blocks == 0
            hit = cache.acquire(
                h.tokens,
                key,
                salt=h.salt,
                max_blocks=share.hit_blocks,
                expect=(share.hit_blocks, share.shared_blocks),
                session=h.session,
            )
            if hit is None:
                return False
            h.pinned, h.shared = list(hit.block_ids), hit.shared
            h.parent, h.offered = (hit.nodes[-1] if hit.nodes else None), len(hit.block_ids)
            return True

    def let_go(self, key: str) -> None:
        """Drop the cache blocks the request holds outside a table and its pins (its reservation ends). A
        no-op for a request that holds none, or is unknown."""
        with self._lock:
            h = self._holdings.get(key)
            if h is None or not h.pinned:
                return
            if self._cache is not None:
                self._cache.release(h.pinned, key, session=h.session)
            h.pinned, h.shared, h.parent, h.offered, h.offering = [], 0, None, 0, True

    def shared_blocks(self, key: str) -> int:
        """Blocks the request holds that were charged to others when it pinned them (0 when unknown)."""
        h = self._holdings.get(key)
        return h.shared if h is not None else 0

    def charged_blocks(self, key: str) -> int:
        """Blocks charged to the request: what it holds or has pinned, less the shared ones (0 when unknown)."""
        with self._lock:
            h = self._holdings.get(key)
            return h.num_blocks() - h.shared if h is not None else 0

    def orphan_blocks(self) -> int:
        """In-use blocks charged to no request: reserved on their sharers' behalf."""
        cache = self._cache
        return cache.orphan_blocks if cache is not None else 0

    def block_states(self) -> BlockStates:
        """Empty, cached, in-use and retained blocks, from one reading."""
        with self._lock:
            if self._pool is None:  # reloading: the old pool is gone, the new one not yet allocated
                return BlockStates(self._total, 0, 0, 0)
            if self._cache is not None:
                return BlockStates(*self._cache.counts())
            empty = self._pool.num_free_blocks
            return BlockStates(empty, 0, self._total - empty, 0)

    # ------------------------------------------------------------------ the engine's thread

    def start(self, key: str, tokens: list[int]) -> int:
        """Begin running a granted request: its table starts with the hit pinned at its grant (none after a
        reset), and `tokens` (the sequence's own list, prompt then output, which the engine extends) are
        what it offers and later looks up. Returns the tokens already computed: the hit's."""
        with self._lock:
            h, builder = self._holdings[key], self._live_builder()
            if h.table is not None:
                raise ValueError(f"request {key!r} is already running")
            h.tokens = tokens
            h.table = builder.new_table(h.pinned)
            h.pinned = []
            return h.table.num_tokens

    def num_tokens(self, key: str) -> int:
        """Tokens with a slot in the request's table (0 when it has none)."""
        h = self._holdings.get(key)
        return h.table.num_tokens if h is not None and h.table is not None else 0

    def blocks_needed(self, batch: Sequence[tuple[str, int]]) -> int:
        """Blocks `build_step(batch)` would take from the pool."""
        with self._lock:
            return sum(self._table(key).blocks_needed(n) for key, n in batch)

    def build_step(self, batch: Sequence[tuple[str, int]]) -> AttentionMetadata:
        """Grow each `(key, new tokens)` request's table by the blocks its new tokens need and return the step's
        attention metadata, in batch order. Cached blocks are evicted first when the empty ones do not cover
        the step (LRU, retention last). Raises `OutOfBlocks` (changing nothing) when even that falls short,
        which admission's reservations make impossible for granted requests."""
        with self._lock:
            entries = [(self._table(key), n) for key, n in batch]
            builder = self._live_builder()
            if self._cache is not None:
                self._cache.ensure_free(builder.blocks_needed(entries))
            return builder.build(entries)

    def load_from_tiers(self, key: str, max_blocks: int) -> int:
        """Continue a just-started request's table with the full blocks of its tokens that a tier below the pool holds
        (at most `max_blocks`, leaving at least its last token to compute): each is read and verified, copied into
        a newly allocated pool block charged to the request (like a computed one, so admission's reservation covers
        it) and offered to the index. Returns the tokens loaded (0: no tier, nothing found, or the first read
        failed). Call it before the request's first step; the engine's thread only."""
        tiers = self._tiers
        with self._lock:
            h, cache = self._holdings[key], self._cache
            if tiers is None or cache is None or h.table is None or not h.offering or max_blocks <= 0:
                return 0
            bs, start = cache.block_size, h.offered
            if h.table.num_tokens != start * bs:
                raise ValueError(f"request {key!r} computed past its hit; load from the tiers before its first step")
            parent = h.parent.hash if h.parent is not None else root_hash(h.salt)
            limit = min(self._limit(h, cache), start + max_blocks)
            tokens = h.tokens
        found = tiers.find(tokens, start, parent, limit)
        data = tiers.read(found) if found else []  # outside the KV's lock: admission's lookups never wait on a disk
        if not data:
            return 0
        with self._lock:
            n, builder = len(data), self._live_builder()
            entries = [(h.table, n * bs)]
            cache.ensure_free(builder.blocks_needed(entries))
            builder.build(entries)
            self.pool.write_blocks(list(h.table.block_ids[start : start + n]), torch.stack(data))
            self.offer(key, (start + n) * bs)
            return n * bs

    def offer_all(self, offers: Iterable[tuple[str, int]]) -> None:
        """`offer(key, num_computed)` for each pair, in order, under one hold of the lock (a step's offers)."""
        with self._lock:
            holdings, cache = self._holdings, self._cache
            if cache is None:
                return
            for key, num_computed in offers:
                self._offer(key, holdings[key], cache, num_computed)

    def offer(self, key: str, num_computed: int) -> None:
        """Index the request's full blocks among its first `num_computed` tokens that it has not offered yet,
        in order. A block whose content is new passes to the index (the request holds it through the index
        from then on); one whose content is indexed already stays the request's own."""
        with self._lock:
            if self._cache is not None:
                self._offer(key, self._holdings[key], self._cache, num_computed)

    @staticmethod
    def _offer(key: str, h: _Holding, cache: PrefixCache, num_computed: int) -> None:
        """`offer` under the lock."""
        if h.table is None or not h.offering:
            return
        bs = cache.block_size
        full = min(num_computed, h.table.num_tokens) // bs
        if full <= h.offered:  # no new full block (most steps): no copy of the table's ids
            return
        ids = h.table.block_ids
        for i in range(h.offered, full):
            node = cache.insert(ids[i], h.tokens[i * bs : (i + 1) * bs], h.parent, key, salt=h.salt)
            if node is None:  # a hash collision with other content: it indexes nothing more
                h.offering = False
                return
            h.parent, h.offered = node, i + 1

    def trim(self, key: str, num_tokens: int) -> None:
        """Forget the request's slots past its first `num_tokens` tokens (a speculative draft's rejected
        positions): blocks its table no longer needs return to the pool at once. Those are always its own
        (never offered: only computed tokens are, and these were not kept), so nothing cached or shared
        changes; the K/V left in the slots of its last block is overwritten before any read. Raises
        `ValueError` when the request has fewer tokens, or a dropped block is indexed."""
        with self._lock:
            table, cache = self._table(key), self._cache
            keep = -(-num_tokens // self.pool.block_size)
            if cache is not None and any(cache.node_of(b) is not None for b in table.block_ids[keep:]):
                raise ValueError(f"request {key!r}: a block past token {num_tokens} is indexed; it cannot be trimmed")
            dropped = self._live_builder().truncate(table, num_tokens)
            if dropped:
                self.pool.decref(dropped)

    def offered_blocks(self, key: str) -> int:
        """Leading full blocks of the request the index holds (those it offered, and its hit)."""
        h = self._holdings.get(key)
        return h.offered if h is not None and h.offering else 0

    def source_for(self, key: str, prefilling: Sequence[str]) -> tuple[str, int] | None:
        """The running request among `prefilling` (those still computing their prompt) that will fill the most
        full blocks of `key`'s prompt beyond what `key`'s hit and its own offers hold, and how many: `key`
        may wait for it and share them instead of computing them twice (one request's `n` choices, concurrent
        turns of one session). None when no such request runs."""
        with self._lock:
            h = self._holdings[key]
            if self._cache is None:
                return None
            bs = self._cache.block_size
            limit = (len(h.tokens) - 1) // bs
            best: tuple[str, int] | None = None
            for other_key in prefilling:
                o = self._holdings.get(other_key)
                if o is None or o is h or o.salt != h.salt or not o.offering or o.table is None:
                    continue
                blocks = _common_blocks(o.tokens, h.tokens, bs, limit)
                if blocks > max(len(h.pinned), o.offered) and (best is None or blocks > best[1]):
                    best = (other_key, blocks)
            return best

    def drop_table(self, key: str) -> None:
        """The request stops running (it ended, or is preempted): its own blocks return to the pool and its row
        is freed; the blocks it held through the index stay held until `let_go` ends its reservation (so
        they turn cached or orphaned atomically with it). A no-op when it has no table."""
        with self._lock:
            h = self._holdings.get(key)
            if h is None or h.table is None:
                return
            ids = self._live_builder().release(h.table)
            h.table = None
            cache = self._cache
            own = [b for b in ids if cache is None or cache.node_of(b) is None]
            h.pinned = [b for b in ids if cache is not None and cache.node_of(b) is not None]
            self.pool.decref(own)

    # ------------------------------------------------------------------ reading

    def holding(self, key: str) -> HoldingView | None:
        """One request's blocks, or None when it is not registered."""
        with self._lock:
            h = self._holdings.get(key)
            return self._view(h) if h is not None else None

    def survey(self) -> KVSurvey:
        """Every block's place and every holding's blocks, in one reading (for display). Raises `RuntimeError`
        while no pool is loaded."""
        with self._lock:
            pool = self.pool
            if self._cache is not None:
                cache = self._cache.survey()
            else:
                cache = CacheSurvey(pool.allocator.free_block_ids(), [], [], {})
            return KVSurvey(cache, [self._view(h) for h in self._holdings.values()])

    def check_integrity(self) -> None:
        """Raise `RuntimeError` unless the pool, the tables, the index and every holding agree: each in-use block
        charged to exactly one holding or orphaned, and every block a table lists held for it (syncs)."""
        with self._lock:
            if self._pool is None:
                if any(h.table is not None or h.pinned for h in self._holdings.values()):
                    raise RuntimeError("kv: blocks held while no pool is loaded")
                return
            builder, cache = self._live_builder(), self._cache
            builder.check_integrity()
            problems: list[str] = []
            own: dict[int, int] = {}
            through_index: dict[int, int] = {}
            for h in self._holdings.values():
                ids = list(h.table.block_ids) if h.table is not None else []
                for b in h.pinned:
                    through_index[b] = through_index.get(b, 0) + 1
                for b in ids:
                    if cache is not None and cache.node_of(b) is not None:
                        through_index[b] = through_index.get(b, 0) + 1
                    else:
                        own[b] = own.get(b, 0) + 1
                if h.table is not None and h.pinned:
                    problems.append(f"{h.key}: pins outside its running table")
                if h.shared > h.num_blocks():
                    problems.append(f"{h.key}: {h.shared} shared of {h.num_blocks()} blocks")
            for b, n in own.items():
                if n != 1 or self._pool.refcount(b) != 1:
                    problems.append(f"block {b}: own block of {n} tables with refcount {self._pool.refcount(b)}")
            if self._tiers is not None:
                self._tiers.check_integrity()
            if cache is not None:
                cache.check_integrity()
                for b, n in through_index.items():
                    if cache.holders(b) != n:
                        problems.append(f"block {b}: held by {n} requests, the index counts {cache.holders(b)}")
                counts = cache.counts()
                charged = sum(h.num_blocks() - h.shared for h in self._holdings.values())
                if charged + cache.orphan_blocks != counts.in_use:
                    orphans = cache.orphan_blocks
                    problems.append(f"{counts.in_use} blocks in use, {charged} charged to requests + {orphans} orphans")
                indexed_holders = sum(1 for n in cache.indexed_blocks() if cache.holders(n.block_id) > 0)
                if indexed_holders != len(through_index):
                    problems.append(f"{indexed_holders} indexed blocks in use, {len(through_index)} held by requests")
            elif len(own) != self._pool.num_allocated_blocks:
                problems.append(f"{self._pool.num_allocated_blocks} blocks allocated, {len(own)} held by tables")
            if problems:
                raise RuntimeError("kv: " + "; ".join(problems[:8]))

    # ------------------------------------------------------------------ internals (lock held)

    def _spill(self, victims: list[CachedBlock]) -> None:
        """The index evicted `victims` (their K/V still in the pool): the tiers keep a copy. Lock held."""
        if self._tiers is not None and self._pool is not None:
            self._tiers.spill(victims, self._pool.read_blocks([v.block_id for v in victims]))

    def _live_builder(self) -> BatchBuilder:
        if self._builder is None:
            raise RuntimeError("no KV pool is loaded (the model is reloading)")
        return self._builder

    def _table(self, key: str) -> BlockTable:
        table = self._holdings[key].table
        if table is None:
            raise ValueError(f"request {key!r} is not running (no block table)")
        return table

    def _limit(self, h: _Holding, cache: PrefixCache) -> int:
        return (len(h.tokens) - 1) // cache.block_size if h.tokens else 0

    def _view(self, h: _Holding) -> HoldingView:
        ids = h.table.block_ids if h.table is not None else tuple(h.pinned)
        return HoldingView(h.key, h.session, ids, len(ids) - h.shared, h.table is not None)


def _common_blocks(tokens: list[int], prompt: list[int], block_size: int, limit: int) -> int:
    """Full blocks (at most `limit`) at the start of `prompt` equal to those at the start of `tokens`."""
    lo, hi = 0, min(limit, len(tokens) // block_size)
    while lo < hi:  # the longest equal run of whole blocks, by bisection over C-speed slice compares
        mid = (lo + hi + 1) // 2
        if tokens[: mid * block_size] == prompt[: mid * block_size]:
            lo = mid
        else:
            hi = mid - 1
    return lo
