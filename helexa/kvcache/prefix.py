"""The prefix cache: full KV blocks found again by a chained hash of their tokens, shared by reference.

    >>> from helexa.kvcache import BlockAllocator, PrefixCache
    >>> allocator = BlockAllocator(8, "cpu")
    >>> cache = PrefixCache(allocator, block_size=4)
    >>> prompt = list(range(10))                       # two full blocks and two tokens more
    >>> ids = allocator.allocate(3).tolist()           # a sequence computes its prompt into 3 blocks...
    >>> ids
    [0, 1, 2]
    >>> parent = None
    >>> for i in range(2):                             # ...and offers each full block to the cache
    ...     parent = cache.insert(ids[i], prompt[4 * i : 4 * i + 4], parent, owner="a")
    >>> allocator.free(ids[2:])                        # the partial block stays the sequence's own
    >>> cache.release(ids[:2], owner="a")              # it ends: its full blocks stay cached
    >>> cache.counts()
    BlockStates(empty=6, cached=2, in_use=0, retained=0)
    >>> hit = cache.acquire(prompt + [99], owner="b")  # the next turn starts with the same 10 tokens
    >>> hit.block_ids, hit.num_tokens, hit.shared      # blocks 0 and 1, charged to "b" now
    ((0, 1), 8, 0)
    >>> cache.counts()
    BlockStates(empty=6, cached=0, in_use=2, retained=0)

Block states (`counts()`): *empty* (on the allocator's free stack), *cached* (full, hashed, held by
no sequence: evictable, and counted as available by admission) and *in use* (held by at least one
sequence, or by a pin taken at admission). The cache owns exactly one allocator reference to every
block it indexes; sequences hold cached blocks through `holders`, so sharing costs no device work.

Charges: every in-use block a sequence holds is counted against exactly one reservation. A block a
request computed or took from the cached set is charged to it (`owner`); a block it found held by
another sequence is *shared* and charged to that one. When the charged owner releases a block others
still hold, the block becomes an *orphan*: still in use, charged to no request, and reserved on the
sharers' behalf (`orphan_blocks`) until the last of them lets go.

Eviction takes cached blocks in this order, O(1) each: retained blocks whose retention ran out, then
the least recently used un-retained blocks, then retained blocks, oldest first. Blocks released together
(a sequence's chain) are evicted from the tail of the chain back to its head, as vLLM does: what stays is
a prefix a later lookup can still reach, and what leaves (to a tier below the pool, when there is one)
is the contiguous rest. A request with a
`session` (an agent's `prompt_cache_key`) retains its blocks for `retention_secs` when it ends.
A lookup compares a candidate's tokens and its parent node, not only the hash, so a hash collision
can never share the wrong KV. Thread-safe: one lock guards the index (admission pins blocks from
request threads while the engine inserts and evicts).

Block hashes are stable: `block_hash` chains SHA-256 over the parent's hash and the block's token ids
from a root that depends only on the cache salt (`root_hash`), so the same tokens hash alike in every
process, after every restart and on every replica — what lets a router that reads the cache's events
(`PrefixCacheListener`, published by `helexa.cluster`) compare blocks across replicas and restarts.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from helexa.kvcache.allocator import BlockAllocator, OutOfBlocks
from helexa.kvcache.survey import CacheSurvey
from helexa.kvprotocol import BlockStates
from helexa.values import check_int

__all__ = ["CacheSurvey", "CachedBlock", "PrefixCache", "PrefixHit"]

_ORPHAN = object()  # the charge of an in-use block whose owner released it while others share it


@dataclass(eq=False)
class CachedBlock:
    """One indexed block: its id, the token ids it holds, its chain hash and parent node.

    `holders` counts the sequences (and pins) using it; at 0 it is cached (evictable).
    """

    block_id: int
    tokens: tuple[int, ...]
    hash: int
    parent: CachedBlock | None
    salt: str | None
    node: int  # unique per insertion: a re-inserted block id is a different node
    holders: int = 0
    charge: object = None  # owner key, _ORPHAN, or None while cached
    retain_until: float = 0.0
    session: Hashable | None = None


@dataclass(frozen=True)
class PrefixHit:
    """Blocks a lookup pinned for a request, in position order.

    `shared` of them were in use by other sequences (charged to them: the request does not reserve
    them); the rest were cached and are now charged to the request. `num_tokens` is what they hold.
    """

    block_ids: tuple[int, ...]
    num_tokens: int
    shared: int
    nodes: tuple[CachedBlock, ...]


_ROOT_DOMAIN = b"helexa/prefix-cache/v1\x00"


def root_hash(salt: str | None) -> int:
    """Where the hash chain of a prompt starts: the last 8 bytes (big-endian) of SHA-256 over a domain tag and
    the cache salt (`None` and every string give different roots, so tenants never share a chain)."""
    data = _ROOT_DOMAIN + (b"\x00" if salt is None else b"\x01" + salt.encode("utf-8"))
    return int.from_bytes(hashlib.sha256(data).digest()[-8:], "big") or 1


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of a full block after `parent` (a block's hash, or `root_hash`): an unsigned 64-bit int.

    SHA-256 over the parent as 8 bytes big-endian followed by the token ids as int64 little-endian,
    cut to the digest's last 8 bytes read big-endian (as vLLM turns its SHA-256 block hashes into the
    64-bit ints of its KV events). The same on every process, platform and restart; never 0 (to llm-d's
    KV indexer a parent hash of 0 means "no parent"). Token ids must fit in an int64.
    """
    data = array("q", tokens)
    if sys.byteorder == "big":
        data.byteswap()
    digest = hashlib.sha256(parent.to_bytes(8, "big") + data.tobytes()).digest()
    return int.from_bytes(digest[-8:], "big") or 1


class PrefixCacheListener(Protocol):
    """Told of every change to the set of indexed blocks, in order, under the cache's lock (keep it quick and
    never call back into the cache). A consumer that applies these calls to a set of block hashes holds
    exactly `{b.hash for b in cache.indexed_blocks()}`."""

    def block_stored(self, node: CachedBlock) -> None:
        """`node` was indexed (its `hash`, `parent`, `tokens`)."""

    def blocks_removed(self, nodes: Sequence[CachedBlock]) -> None:
        """`nodes` were evicted: no longer indexed."""

    def all_cleared(self) -> None:
        """The index is empty (a `clear()` that left nothing indexed)."""


class PrefixCache:
    """Index of full KV blocks by chained hash over one `BlockAllocator`; see the module docstring.

    Guarantees (checked by `check_integrity`): every indexed block holds exactly one allocator
    reference (the cache's); a block with holders 0 is in exactly one eviction list; `orphan_blocks`
    equals the in-use blocks charged to no owner; `counts()` sums to the pool's total.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        *,
        retention_secs: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[list[CachedBlock]], None] | None = None,
    ) -> None:
        self.allocator = allocator
        self._on_evict = on_evict  # told of each eviction's blocks while their K/V are still in the pool
        self.block_size = check_int(block_size, "block_size")
        if retention_secs < 0:
            raise ValueError(f"retention_secs must be >= 0, got {retention_secs}")
        self.retention_secs = float(retention_secs)
        self._clock = clock
        self._lock = threading.RLock()
        self._by_hash: dict[int, CachedBlock] = {}
        self._by_block: dict[int, CachedBlock] = {}
        self._lru: OrderedDict[int, CachedBlock] = OrderedDict()  # cached, not retained: oldest first
        self._retained: OrderedDict[int, CachedBlock] = OrderedDict()  # cached, retained: earliest expiry first
        self._sessions: dict[Hashable, set[int]] = {}  # session -> block ids it retains
        self._nodes = itertools.count(1)
        self._orphans = 0
        self._listener: PrefixCacheListener | None = None
        self.evictions = 0  # blocks evicted since start

    # ------------------------------------------------------------------ reading

    def counts(self) -> BlockStates:
        """Empty, cached, in-use and retained blocks, from one reading under the lock."""
        with self._lock:
            empty = self.allocator.num_free_blocks
            cached = len(self._lru) + len(self._retained)
            return BlockStates(empty, cached, self.allocator.num_blocks - empty - cached, len(self._retained))

    @property
    def num_cached(self) -> int:
        """Cached (evictable) blocks."""
        return len(self._lru) + len(self._retained)

    @property
    def num_indexed(self) -> int:
        """Blocks in the index: cached ones and in-use ones that are hashed."""
        return len(self._by_block)

    @property
    def orphan_blocks(self) -> int:
        """In-use blocks whose charged owner released them while other sequences still share them."""
        return self._orphans

    @property
    def lock(self) -> threading.RLock:
        """The cache's lock (re-entrant): hold it to read several numbers as one."""
        return self._lock

    def match(self, tokens: Sequence[int], salt: str | None = None, max_blocks: int | None = None) -> list[CachedBlock]:
        """The longest run of indexed blocks that equals `tokens`' full blocks from the start (at most
        `max_blocks`), verified token for token and parent by parent. Pins nothing."""
        with self._lock:
            return self._match(tokens, salt, max_blocks)

    def indexed_blocks(self) -> list[CachedBlock]:
        """Every indexed block (cached or in use), parents before their children (in the order they were indexed)."""
        with self._lock:
            return sorted(self._by_block.values(), key=lambda node: node.node)

    def set_listener(self, listener: PrefixCacheListener | None) -> None:
        """Tell `listener` of every later store, eviction and clear (None: tell no one)."""
        with self._lock:
            self._listener = listener

    def holders(self, block_id: int) -> int:
        """Sequences (and pins) holding an indexed block; 0 for a cached one. Raises `KeyError` if not indexed."""
        return self._by_block[block_id].holders

    def node_of(self, block_id: int) -> CachedBlock | None:
        """The index entry of a block, or None when the block is not indexed."""
        return self._by_block.get(block_id)

    def survey(self) -> CacheSurvey:
        """Every block's place (free, evictable in eviction order, retained by which session), read under the
        lock with one copy of the allocator's free stack. Read-only, for display; O(blocks) in C-level copies."""
        with self._lock:
            now = self._clock()
            retained = list(self._retained)
            expired = 0  # retained blocks whose retention ran out are evicted first (see `_pop_victim`)
            for node in self._retained.values():
                if node.retain_until > now:
                    break
                expired += 1
            evictable = retained[:expired] + list(self._lru) + retained[expired:]
            sessions = {s: list(ids) for s, ids in self._sessions.items() if ids}
            return CacheSurvey(self.allocator.free_block_ids(), evictable, retained, sessions)

    # ------------------------------------------------------------------ sharing

    def acquire(
        self,
        tokens: Sequence[int],
        owner: Hashable,
        *,
        salt: str | None = None,
        max_blocks: int | None = None,
        expect: tuple[int, int] | None = None,
        session: Hashable | None = None,
    ) -> PrefixHit | None:
        """Pin the longest cached prefix of `tokens` for `owner`, leaving at least the last token to compute.

        At most `(len(tokens) - 1) // block_size` blocks (and `max_blocks`) are taken.
        With `expect=(hit, shared)` (what an earlier `match` found), the hit is pinned only when it is still
        exactly that many blocks with that many of them in use; otherwise nothing is pinned and None is
        returned (the check and the pin are one step under the lock). On success every
        hit block gains a holder; a cached one leaves the evictable set and is charged to `owner`.
        With a `session`, that session's previously retained blocks that this prompt no longer matches
        lose their retention.
        """
        limit = (len(tokens) - 1) // self.block_size if tokens else 0
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        with self._lock:
            hits = self._match(tokens, salt, limit)
            shared = sum(1 for node in hits if node.holders > 0)
            if expect is not None and (len(hits), shared) != tuple(expect):
                return None
            for node in hits:
                if node.holders == 0:
                    self._unlist(node)
                    node.charge = owner
                node.holders += 1
            if session is not None:
                self._forget_session(session, keep={node.block_id for node in hits})
            ids = tuple(node.block_id for node in hits)
            return PrefixHit(ids, len(ids) * self.block_size, shared, tuple(hits))

    def insert(
        self,
        block_id: int,
        tokens: Sequence[int],
        parent: CachedBlock | None,
        owner: Hashable,
        *,
        salt: str | None = None,
    ) -> CachedBlock | None:
        """Offer a full, computed block (`block_size` tokens, after `parent`'s) to the index.

        When its content is new, the cache takes over the caller's allocator reference to `block_id`
        (the caller keeps holding the block through the cache, charged to `owner`) and returns the new
        entry. When equal content is already indexed, the caller keeps its own block and reference and
        gets the existing entry (to chain the next block from); equal content means equal tokens after an
        equal chain of tokens, so an entry whose parent was evicted and indexed again (computed or loaded
        from a tier) is relinked to the new parent. None on a hash collision with other content (the
        caller keeps its block; its later blocks are not indexed).
        """
        tokens = tuple(tokens)
        if len(tokens) != self.block_size:
            raise ValueError(f"insert: a block holds {self.block_size} tokens, got {len(tokens)}")
        with self._lock:
            if block_id in self._by_block:
                raise ValueError(f"insert: block {block_id} is already indexed")
            if self.allocator.refcount_of(block_id) != 1:
                raise ValueError(f"insert: block {block_id} must be held once by its caller")
            h = block_hash(parent.hash if parent is not None else root_hash(salt), tokens)
            existing = self._by_hash.get(h)
            if existing is not None:
                if existing.tokens != tokens or existing.salt != salt or not self._same_chain(existing.parent, parent):
                    return None
                existing.parent = parent  # (its old parent was evicted and its content indexed again: relink)
                return existing
            node = CachedBlock(block_id, tokens, h, parent, salt, next(self._nodes), holders=1, charge=owner)
            self._by_hash[h] = node
            self._by_block[block_id] = node
            if self._listener is not None:
                self._listener.block_stored(node)
            return node

    def release(self, block_ids: Iterable[int], owner: Hashable, *, session: Hashable | None = None) -> None:
        """Drop one holder from each indexed block (a sequence ending or preempted, or a pin let go).

        Blocks charged to `owner` that others still hold become orphans. A block left with no holder
        becomes cached: retained until `now + retention_secs` when a `session` is given (the session
        then remembers it), else at the most-recently-used end of the LRU list. Raises `ValueError`,
        changing nothing, for a block that is not indexed or has no holder.
        """
        block_ids = list(block_ids)
        with self._lock:
            nodes = [self._by_block.get(b) for b in block_ids]
            for b, node in zip(block_ids, nodes):
                if node is None or self._by_block.get(b) is not node or node.holders == 0:
                    raise ValueError(f"release: block {b} is not an indexed block in use")
            now = self._clock()
            if session is not None:
                retained = self._sessions.setdefault(session, set())
            for node in reversed(nodes):  # a chain's tail reaches the eviction lists first: it is evicted first
                assert node is not None
                node.holders -= 1
                if session is not None and self.retention_secs > 0:
                    node.retain_until, node.session = now + self.retention_secs, session
                    retained.add(node.block_id)
                if node.holders > 0:
                    if node.charge is not _ORPHAN and node.charge == owner:
                        node.charge = _ORPHAN
                        self._orphans += 1
                    continue
                if node.charge is _ORPHAN:
                    self._orphans -= 1
                node.charge = None
                if node.retain_until > now:
                    self._retained[node.block_id] = node
                    self._retained.move_to_end(node.block_id)
                else:
                    self._lru[node.block_id] = node

    # ------------------------------------------------------------------ eviction

    def ensure_free(self, n: int, *, spill: bool = True) -> int:
        """Evict cached blocks until the allocator has `n` free ones; returns how many were evicted. With `spill`,
        the `on_evict` callback is given the evicted blocks before anything can overwrite their K/V (the tiers
        below the pool keep them).

        Raises `OutOfBlocks` (evicting nothing) when even every cached block would not make room.
        """
        check_int(n, "n", 0)
        with self._lock:
            short = n - self.allocator.num_free_blocks
            if short <= 0:
                return 0
            if short > self.num_cached:
                raise OutOfBlocks(n, self.allocator.num_free_blocks + self.num_cached, self.allocator.num_blocks)
            victims = [self._pop_victim() for _ in range(short)]
            for node in victims:
                del self._by_hash[node.hash]
                del self._by_block[node.block_id]
                if node.session is not None:
                    self._sessions.get(node.session, set()).discard(node.block_id)
            self.allocator.free([node.block_id for node in victims])
            self.evictions += short
            if self._listener is not None:
                self._listener.blocks_removed(victims)
            if spill and self._on_evict is not None:
                self._on_evict(victims)
            return short

    def clear(self) -> int:
        """Evict every cached block (in-use blocks stay indexed, nothing spills); returns how many were evicted. The
        listener hears of each eviction, then (when nothing stays indexed) `all_cleared`."""
        with self._lock:
            evicted = self.ensure_free(self.allocator.num_free_blocks + self.num_cached, spill=False)
            if not self._by_block and self._listener is not None:
                self._listener.all_cleared()
            return evicted

    # ------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Raise `RuntimeError` unless the index, the eviction lists, the charges and the allocator agree."""
        with self._lock:
            problems = []
            orphans = 0
            for b, node in self._by_block.items():
                if self._by_hash.get(node.hash) is not node or node.block_id != b:
                    problems.append(f"block {b}: index entries disagree")
                if self.allocator.refcount_of(b) != 1:
                    problems.append(f"block {b}: allocator refcount {self.allocator.refcount_of(b)}, expected 1")
                listed = (b in self._lru) + (b in self._retained)
                if node.holders < 0 or (node.holders == 0) != (listed == 1) or listed > 1:
                    problems.append(f"block {b}: holders {node.holders}, in {listed} eviction lists")
                if node.holders == 0 and node.charge is not None:
                    problems.append(f"block {b}: cached but charged")
                if node.holders > 0 and node.charge is None:
                    problems.append(f"block {b}: in use but charged to nobody")
                orphans += node.charge is _ORPHAN
            if orphans != self._orphans:
                problems.append(f"orphan count {self._orphans} != orphaned blocks {orphans}")
            if len(self._by_hash) != len(self._by_block):
                problems.append("hash and block indexes differ in size")
            for b in (*self._lru, *self._retained):
                if b not in self._by_block:
                    problems.append(f"block {b} listed for eviction but not indexed")
            if problems:
                raise RuntimeError("prefix cache: " + "; ".join(problems[:8]))

    # ------------------------------------------------------------------ internals (lock held)

    def _match(self, tokens: Sequence[int], salt: str | None, max_blocks: int | None) -> list[CachedBlock]:
        bs = self.block_size
        limit = len(tokens) // bs if max_blocks is None else min(max_blocks, len(tokens) // bs)
        hits: list[CachedBlock] = []
        parent: CachedBlock | None = None
        h = root_hash(salt)
        for i in range(limit):
            block = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(h, block)
            node = self._by_hash.get(h)
            if node is None or node.tokens != block or node.parent is not parent or node.salt != salt:
                break
            hits.append(node)
            parent = node
        return hits

    def _same_chain(self, old: CachedBlock | None, new: CachedBlock | None) -> bool:
        """True when `old` is `new`, or `old` is an evicted node whose chain holds exactly `new`'s tokens back to
        where the two meet (compared token for token, never by hash)."""
        while old is not new:
            if old is None or new is None or self._by_block.get(old.block_id) is old:
                return False  # a live node that is not `new`: another chain
            if old.tokens != new.tokens or old.salt != new.salt:
                return False
            old, new = old.parent, new.parent
        return True

    def _unlist(self, node: CachedBlock) -> None:
        if self._lru.pop(node.block_id, None) is None:
            del self._retained[node.block_id]

    def _pop_victim(self) -> CachedBlock:
        """The next block to evict: an expired retained one, else the LRU one, else the oldest retained one."""
        if self._retained:
            first = next(iter(self._retained.values()))
            if first.retain_until <= self._clock() or not self._lru:
                return self._retained.popitem(last=False)[1]
        return self._lru.popitem(last=False)[1]

    def _forget_session(self, session: Hashable, keep: set[int]) -> None:
        """The session's retained blocks outside `keep` lose their retention (cached ones become first to go)."""
        for b in self._sessions.get(session, set()) - keep:
            node = self._by_block.get(b)
            if node is None:
                continue
            node.retain_until, node.session = 0.0, None
            if self._retained.pop(b, None) is not None:
                self._lru[b] = node
                self._lru.move_to_end(b, last=False)
        self._sessions[session] = set(keep) & self._sessions.get(session, set())
