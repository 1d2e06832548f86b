"""The tiers below the pool: where a block the prefix cache evicts goes instead of vanishing, and comes back from.

    tiers = KVTiers(identity, host_bytes=2 << 30, disk_path="/var/cache/helexa/kv", disk_bytes=64 << 30)
    tiers.spill(nodes, pool.read_blocks(ids))      # the prefix cache evicts: K/V go down a tier
    found = tiers.find(tokens, start, parent, limit)   # a prompt's next full blocks, verified by tokens and parent
    data = tiers.read(found)                       # their K/V, each verified; stops at the first that fails

Order: host memory, then disk. A block evicted from the pool goes to the first tier (or is refreshed there
when a tier holds it already: a loaded block stays in its tier, so evicting it again writes nothing); a
block a full tier drops goes to the next tier, and leaves the last one for good. A hash lives in at most
one tier. Retained sessions' blocks are the last each tier drops (`TierIndex`).

Admission never counts tier blocks: loading a block allocates a new pool block for the request, like a
computed one. `KVManager` (the KV owner) is the only caller; it records which pool block holds what, and
this object which tier holds what. Thread-safe: one lock (the disk writer thread takes it too).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from os import PathLike
from typing import Any, NamedTuple, Protocol

import torch

from helexa.kvcache.prefix import CachedBlock, block_hash, root_hash
from helexa.kvcache.tiers.disk import DiskTier, file_bytes
from helexa.kvcache.tiers.host import HostTier
from helexa.kvcache.tiers.identity import KVIdentity
from helexa.kvcache.tiers.index import TierBlock

__all__ = ["KVTiers", "TierHit", "TierListener", "TierStats"]

Tier = HostTier | DiskTier


class TierListener(Protocol):
    """Told of every change to what the tiers hold, under their lock (keep it quick, never call back)."""

    def tier_stored(self, medium: str, blocks: Sequence[TierBlock]) -> None:
        """`blocks` are now held in the tier `medium` (`CPU_HOST`, `DISK`)."""

    def tier_removed(self, medium: str, hashes: Sequence[int]) -> None:
        """The blocks `hashes` left the tier `medium`."""


class TierHit(NamedTuple):
    """A block a lookup found below the pool, and the tier holding it."""

    tier: Tier
    block: TierBlock


class TierStats(NamedTuple):
    """One tier's contents and totals, read at one instant (see `TierCounters` for the counters)."""

    name: str
    medium: str
    blocks: int
    bytes: int
    capacity_bytes: int
    hits: int
    loads: int
    writes: int
    drops: int
    failures: int


class KVTiers:
    """The host-memory and disk tiers (each optional, at least one) for blocks of one `identity`.

    Guarantees (`check_integrity`): each tier within its byte budget; a hash in at most one tier; a read
    returns K/V only for a block that verified (tokens and parent by the index, checksum and identity on
    disk), so a failure is a miss and never wrong KV.
    """

    # `snapshot()`'s fields when there is no tier
    NONE: dict[str, Any] = {"blocks_host": 0, "blocks_disk": 0, "kv_tiers": {}, "kv_tier_load_bytes_per_second": None}

    def __init__(
        self,
        identity: KVIdentity,
        *,
        host_bytes: int | None = None,
        disk_path: str | PathLike | None = None,
        disk_bytes: int | None = None,
        pin: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if host_bytes is None and disk_path is None:
            raise ValueError("KVTiers needs a host tier (host_bytes) or a disk tier (disk_path)")
        if disk_path is None and disk_bytes is not None:
            raise ValueError("a disk tier's size (--kv-disk-bytes) needs its directory (--kv-disk-path)")
        self.identity = identity
        self._clock = clock
        self._lock = threading.RLock()
        self._listener: TierListener | None = None
        self.tiers: list[Tier] = []
        if host_bytes is not None:
            self.tiers.append(HostTier(host_bytes, pin=pin))
        if disk_path is not None:
            size = disk_bytes if disk_bytes is not None else 64 << 30
            self.tiers.append(DiskTier(disk_path, size, identity, lock=self._lock, on_lost=self._lost))
        self.load_bytes = 0  # K/V bytes read back into the pool since start
        self.load_seconds = 0.0  # and the time those reads took

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def set_listener(self, listener: TierListener | None) -> None:
        """Tell `listener` of every later store and removal (None: tell no one)."""
        with self._lock:
            self._listener = listener

    # ------------------------------------------------------------------ the KV owner's calls

    def spill(self, nodes: Sequence[CachedBlock], payload: torch.Tensor) -> None:
        """The prefix cache evicted `nodes`: keep their K/V (`payload`, (n, num_layers, 2, block_size, num_kv_heads,
        head_dim) on the host, `BlockPool.read_blocks` of their ids) in the first tier, or refresh the copy a
        tier holds already. Never waits for a disk."""
        if len(nodes) != payload.shape[0]:
            raise ValueError(f"spill: {len(nodes)} blocks, {payload.shape[0]} payloads")
        with self._lock:
            now = self._clock()
            for node, data in zip(nodes, payload.unbind(0)):
                parent = node.parent.hash if node.parent is not None else root_hash(node.salt)
                held = self._holding(node.hash)
                if held is not None:
                    if held.block.matches(parent, node.tokens):  # loaded before: its tier still has it
                        held.tier.index.touch(held.block, node.retain_until, now)
                        self._stored(held.tier.medium, [held.block])
                    continue  # (another block with this hash: a collision; keep the one held)
                block = TierBlock(node.hash, parent, node.parent is None, node.tokens, 0, node.retain_until)
                self._put(0, block, data, now)

    def find(self, tokens: Sequence[int], start: int, parent: int, limit: int) -> list[TierHit]:
        """The blocks `start`, `start + 1`, ... (at most up to block `limit`) of `tokens` that the tiers hold, in
        order from `start` until the first one they do not: `parent` is the chain value before block `start`
        (its parent's hash, or `root_hash(salt)` at 0). Verified by tokens and parent, read nothing yet."""
        with self._lock:
            out = self._chain(tokens, start, parent, limit)
            for held in out:
                held.tier.counters.hits += 1
        return out

    def peek(self, tokens: Sequence[int], start: int, parent: int, limit: int) -> int:
        """How many blocks `find` would return now, counting nothing and reading nothing (admission's estimate of
        what a request will load instead of compute)."""
        with self._lock:
            return len(self._chain(tokens, start, parent, limit))

    @property
    def load_seconds_per_block(self) -> float | None:
        """The measured time to read one block back (file or memory, verification and copy included): the loads'
        total time over their blocks since start. None before any load."""
        blocks = self.load_bytes // self.identity.payload_bytes
        return self.load_seconds / blocks if blocks > 0 else None

    def read(self, found: Sequence[TierHit]) -> list[torch.Tensor]:
        """The K/V of `found`'s blocks in order, each (num_layers, 2, block_size, num_kv_heads, head_dim), stopping at
        the first that is gone or fails to verify (that one is dropped and counted). Each read refreshes the block
        in its tier's LRU."""
        out: list[torch.Tensor] = []
        t0 = time.perf_counter()
        with self._lock:
            now = self._clock()
            for hit in found:
                data = hit.tier.read(hit.block)
                if data is None:
                    break
                hit.tier.counters.loads += 1
                hit.tier.index.touch(hit.block, 0.0, now)
                out.append(data)
        self.load_seconds += time.perf_counter() - t0
        self.load_bytes += len(out) * self.identity.payload_bytes
        return out

    def clear(self) -> int:
        """Drop every block of every tier (a cache flush); returns how many."""
        with self._lock:
            n = 0
            for tier in self.tiers:
                hashes = [b.hash for b in tier.index]
                for h in hashes:
                    tier.discard(h)
                tier.counters.drops += len(hashes)
                n += len(hashes)
                if hashes and self._listener is not None:
                    self._listener.tier_removed(tier.medium, hashes)
            return n

    # ------------------------------------------------------------------ reading

    def stats(self) -> list[TierStats]:
        """Every tier's contents and counters, host first, from one reading."""
        with self._lock:
            return [
                TierStats(t.name, t.medium, len(t.index), t.index.nbytes, t.index.capacity_bytes, t.counters.hits,
                          t.counters.loads, t.counters.writes, t.counters.drops, t.counters.failures)
                for t in self.tiers
            ]  # fmt: skip

    def snapshot(self) -> dict[str, Any]:
        """The `GET /v1/admission` fields: `blocks_host`, `blocks_disk`, `kv_tiers` (each tier's numbers by name)
        and the measured load bandwidth (`kv_tier_load_bytes_per_second`, None before any load)."""
        stats = self.stats()
        by_name = {s.name: s._asdict() for s in stats}
        rate = self.load_bytes / self.load_seconds if self.load_seconds > 0 else None
        return {
            "blocks_host": by_name.get("host", {}).get("blocks", 0),
            "blocks_disk": by_name.get("disk", {}).get("blocks", 0),
            "kv_tiers": by_name,
            "kv_tier_load_bytes_per_second": rate,
        }

    def blocks(self) -> list[tuple[str, TierBlock]]:
        """Every block below the pool with its tier's medium (for a KV event resync)."""
        with self._lock:
            return [(t.medium, b) for t in self.tiers for b in t.index]

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for the disk tier's queued writes (True when none is left)."""
        return all(t.flush(timeout) for t in self.tiers if isinstance(t, DiskTier))

    def close(self) -> None:
        """Finish queued writes and stop the disk writer."""
        for tier in self.tiers:
            tier.close()

    def check_integrity(self) -> None:
        """Raise `RuntimeError` unless every tier is within budget and agrees with itself, and no hash is in two
        tiers."""
        with self._lock:
            seen: set[int] = set()
            for tier in self.tiers:
                tier.check_integrity()
                hashes = {b.hash for b in tier.index}
                if hashes & seen:
                    raise RuntimeError(f"kv tiers: {len(hashes & seen)} blocks in two tiers")
                seen |= hashes

    def describe(self) -> str:
        """One log line: each tier's budget."""
        parts = []
        for t in self.tiers:
            where = f" at {t.path}" if isinstance(t, DiskTier) else ""
            parts.append(f"{t.name}={t.index.capacity_bytes / 2**20:.0f}MiB{where} ({len(t.index)} blocks)")
        return "kv tiers: " + " ".join(parts) + f" block={self.identity.payload_bytes}B dtype={self.identity.dtype}"

    # ------------------------------------------------------------------ internals (lock held)

    def _chain(self, tokens: Sequence[int], start: int, parent: int, limit: int) -> list[TierHit]:
        """The held blocks `start`, `start + 1`, ... below `limit` of `tokens`, up to the first one no tier holds."""
        bs = self.identity.block_size
        out: list[TierHit] = []
        for i in range(start, limit):
            block_tokens = tokens[i * bs : (i + 1) * bs]
            h = block_hash(parent, block_tokens)
            held = self._holding(h)
            if held is None or not held.block.matches(parent, block_tokens):
                break
            out.append(held)
            parent = h
        return out

    def _holding(self, h: int) -> TierHit | None:
        for tier in self.tiers:
            block = tier.index.get(h)
            if block is not None:
                return TierHit(tier, block)
        return None

    def _put(self, level: int, block: TierBlock, data: torch.Tensor, now: float) -> None:
        tier = self.tiers[level]
        payload = self.identity.payload_bytes
        block.nbytes = file_bytes(len(block.tokens), payload) if isinstance(tier, DiskTier) else payload
        dropped = tier.put(block, data, now)
        removed = [v.hash for v, _ in dropped if v is not block]
        if removed and self._listener is not None:
            self._listener.tier_removed(tier.medium, removed)
        if not dropped or dropped[-1][0] is not block:
            self._stored(tier.medium, [block])
        if level + 1 < len(self.tiers):
            for victim, victim_data in dropped:
                if victim_data is not None:
                    lower = TierBlock(victim.hash, victim.parent, victim.first, victim.tokens, 0, victim.retain_until)
                    self._put(level + 1, lower, victim_data, now)

    def _stored(self, medium: str, blocks: list[TierBlock]) -> None:
        if self._listener is not None:
            self._listener.tier_stored(medium, blocks)

    def _lost(self, block: TierBlock) -> None:
        if self._listener is not None:
            self._listener.tier_removed(DiskTier.medium, [block.hash])
