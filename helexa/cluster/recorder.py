"""The engine's side of the KV event stream: what the prefix cache stores and evicts, one batch per step.

`KVEventRecorder` listens to a `PrefixCache` (`PrefixCacheListener`): each newly indexed block becomes
a `BlockStored` (consecutive blocks of one chain share one event, as vLLM batches them), each eviction
a `BlockRemoved`. `end_step()` hands the step's events to the publisher as one `KVEventBatch` without
ever blocking. Whole-cache changes are spelled out block by block, so a consumer that ignores
`AllBlocksCleared` (llm-d's indexer logs it and does nothing) still ends with the right set:

- start: `AllBlocksCleared` (a new engine holds nothing; a consumer may still know a previous one);
- reload after a device fault: `BlockRemoved` of every block the dropped cache indexed, then
  `AllBlocksCleared`;
- after a batch was dropped (the publisher's queue was full): the next batch that fits is a resync,
  `AllBlocksCleared` then `BlockStored` of every block indexed now (parents first), which replaces the
  lost events for a consumer that honours `AllBlocksCleared`.

With tiers below the pool (`KVTiers`, `TierListener`), every event carries its block's `medium`: the
pool's (`pool_medium`: "GPU", or "CPU" for a CPU engine), `CPU_HOST` or `DISK`. A block that moves down
(the pool evicts it into a tier, or a full tier hands it to the next) is removed from the medium it left
before it is stored in the one it reaches, so a consumer that ignores `medium` still holds every block
that is anywhere on this replica, and drops a block only when it leaves the last tier. The tiers outlive
a reload, so `AllBlocksCleared` is followed by their blocks again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from threading import Lock

from helexa.cluster.events import MEDIUM, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from helexa.cluster.publisher import KVEventPublisher
from helexa.kvcache.prefix import CachedBlock, PrefixCache
from helexa.kvcache.tiers import KVTiers, TierBlock

__all__ = ["KVEventRecorder"]

logger = logging.getLogger("helexa.cluster")

Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventRecorder:
    """Turns prefix-cache changes into event batches for a `KVEventPublisher` (which it owns and closes).

    Guarantees: events are published in the order the cache changed; `end_step` never blocks; a
    consumer that applies every published batch in sequence order (`BlockStored` adds its hashes,
    `BlockRemoved` removes them, `AllBlocksCleared` empties the set) holds exactly the hashes of
    `cache.indexed_blocks()` after each batch — also after a reload, and after a dropped batch once
    the resync that follows it is published. Thread-safe: the listener calls come under the cache's lock.
    """

    def __init__(
        self,
        publisher: KVEventPublisher,
        block_size: int,
        *,
        data_parallel_rank: int = 0,
        medium: str = MEDIUM,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self.medium = medium  # the pool's blocks' `medium` ("GPU", or "CPU" for a pool in host memory)
        self.data_parallel_rank = data_parallel_rank
        self._clock = clock
        self._lock = Lock()  # guards _pending (the cache's lock, when taken, is taken first)
        self._pending: list[Event] = []
        self._cache: PrefixCache | None = None
        self._tiers: KVTiers | None = None
        self._resync = False  # a batch was dropped: the next one that fits is a full resync
        self._dropped_since_resync = 0
        self._skipped = 0  # steps' batches not even offered to the publisher while it was full (awaiting a resync)

    @classmethod
    def open(
        cls,
        endpoint: str,
        *,
        replay_endpoint: str | None,
        topic: str,
        block_size: int,
        medium: str = MEDIUM,
        tagged_maps: bool = False,
        queue_batches: int = 1024,
        buffer_batches: int = 10_000,
    ) -> KVEventRecorder:
        """A recorder over a new, started publisher on `endpoint` (raises `OSError` if it cannot bind or connect)."""
        publisher = KVEventPublisher(
            endpoint,
            replay_endpoint=replay_endpoint,
            topic=topic,
            tagged_maps=tagged_maps,
            queue_batches=queue_batches,
            buffer_batches=buffer_batches,
        )
        publisher.start()
        logger.info(
            "kv events: publishing on %s (replay: %s) topic=%r block_size=%d medium=%s encoding=%s",
            publisher.endpoint, publisher.replay_endpoint or "off", topic, block_size, medium,
            "map" if tagged_maps else "array",
        )  # fmt: skip
        return cls(publisher, block_size, medium=medium)

    # ------------------------------------------------------------------ engine

    def start(self, cache: PrefixCache | None, tiers: KVTiers | None = None) -> None:
        """Listen to `cache` (None: the prefix cache is off) and `tiers` (None: none) and publish `AllBlocksCleared`,
        then what the tiers hold from before (a disk tier survives a restart)."""
        self.attach(cache)
        self._tiers = tiers
        if tiers is not None:
            with tiers.lock:
                tiers.set_listener(self)
                with self._lock:
                    self._pending.append(AllBlocksCleared())
                    self._stored_below(self._pending, tiers)
        else:
            with self._lock:
                self._pending.append(AllBlocksCleared())
        self.end_step()

    def attach(self, cache: PrefixCache | None) -> None:
        """Listen to `cache` from now on (a reload's new, empty one)."""
        self._cache = cache
        if cache is not None:
            cache.set_listener(self)

    def cache_dropped(self, cache: PrefixCache | None) -> None:
        """`cache` is being dropped (a reload): publish the removal of every block it indexed, then
        `AllBlocksCleared`; stop listening to it."""
        if cache is None:
            return
        tiers = self._tiers
        below: AbstractContextManager = tiers.lock if tiers is not None else nullcontext()
        with cache.lock, below:  # lock order: the cache's, the tiers', then this recorder's
            nodes = cache.indexed_blocks()
            cache.set_listener(None)
            with self._lock:
                if nodes:
                    self._removed(nodes)
                self._pending.append(AllBlocksCleared())
                if tiers is not None:  # they outlive the pool: still on this replica
                    self._stored_below(self._pending, tiers)
        if self._cache is cache:
            self._cache = None
        self.end_step()

    def end_step(self) -> None:
        """Publish the events since the last call as one batch (nothing when there were none); never blocks."""
        if self._resync:
            self._publish_resync()
            return
        with self._lock:
            if not self._pending:
                return
            events, self._pending = self._pending, []
            if self.publisher.publish(self._batch(events)):
                return
            self._resync, self._dropped_since_resync = True, 1
        logger.warning(
            "kv events: dropped a batch of %d events (%d batches wait to be sent); a full resync follows when "
            "the queue has room", len(events), self.publisher.pending,
        )  # fmt: skip

    def close(self) -> None:
        """Publish what is pending, stop listening, and close the publisher (sending what it has queued)."""
        self.end_step()
        if self._cache is not None:
            self._cache.set_listener(None)
            self._cache = None
        if self._tiers is not None:
            self._tiers.set_listener(None)
            self._tiers = None
        self.publisher.close()

    @property
    def published(self) -> int:
        """Batches sent so far (the next sequence number)."""
        return self.publisher.published

    @property
    def dropped(self) -> int:
        """Steps' batches dropped because the publisher's queue was full (never sent; a resync replaced them)."""
        return self.publisher.dropped + self._skipped

    # ------------------------------------------------------------------ PrefixCacheListener (cache lock held)

    def block_stored(self, node: CachedBlock) -> None:
        with self._lock:
            self._append_stored(self._pending, node)

    def blocks_removed(self, nodes: Sequence[CachedBlock]) -> None:
        with self._lock:
            self._removed(nodes)

    def all_cleared(self) -> None:
        with self._lock:
            self._pending.append(AllBlocksCleared())

    # ------------------------------------------------------------------ TierListener (the tiers' lock held)

    def tier_stored(self, medium: str, blocks: Sequence[TierBlock]) -> None:
        with self._lock:
            for block in blocks:
                _append(self._pending, block.hash, None if block.first else block.parent, block.tokens, medium,
                        self.block_size)  # fmt: skip

    def tier_removed(self, medium: str, hashes: Sequence[int]) -> None:
        with self._lock:
            self._removed_hashes(list(hashes), medium)

    # ------------------------------------------------------------------ internals

    def _removed(self, nodes: Sequence[CachedBlock]) -> None:
        self._removed_hashes([node.hash for node in nodes], self.medium)

    def _removed_hashes(self, hashes: list[int], medium: str) -> None:
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.extend(hashes)
        else:
            self._pending.append(BlockRemoved(block_hashes=hashes, medium=medium))

    def _append_stored(self, events: list[Event], node: CachedBlock) -> None:
        """Add the pool's `node` to `events`."""
        parent = node.parent.hash if node.parent is not None else None
        _append(events, node.hash, parent, node.tokens, self.medium, self.block_size)

    def _stored_below(self, events: list[Event], tiers: KVTiers) -> None:
        """Append a `BlockStored` of every block the tiers hold (their lock and `_lock` held)."""
        for medium, block in tiers.blocks():
            _append(events, block.hash, None if block.first else block.parent, block.tokens, medium, self.block_size)

    def _batch(self, events: list[Event]) -> KVEventBatch:
        return KVEventBatch(ts=self._clock(), events=events, data_parallel_rank=self.data_parallel_rank)

    def _publish_resync(self) -> None:
        """While the queue is full, drop the step's events (the resync will cover them); once it has room,
        publish `AllBlocksCleared` + every indexed block, from one reading of the cache."""
        cache, tiers = self._cache, self._tiers
        guard: AbstractContextManager = cache.lock if cache is not None else nullcontext()
        below: AbstractContextManager = tiers.lock if tiers is not None else nullcontext()
        with guard, below, self._lock:
            if self.publisher.pending >= self.publisher.capacity:
                if self._pending:
                    self._pending = []
                    self._skipped += 1
                    self._dropped_since_resync += 1
                return
            self._pending = []
            events: list[Event] = [AllBlocksCleared()]
            nodes = cache.indexed_blocks() if cache is not None else []
            for node in nodes:
                self._append_stored(events, node)
            if tiers is not None:
                self._stored_below(events, tiers)
            if not self.publisher.publish(self._batch(events)):
                return
            self._resync = False
            dropped, self._dropped_since_resync = self._dropped_since_resync, 0
        logger.warning(
            "kv events: resynced after %d dropped batches: AllBlocksCleared + %d blocks", dropped, len(nodes)
        )


def _append(
    events: list[Event], h: int, parent: int | None, tokens: Sequence[int], medium: str, block_size: int
) -> None:
    """Add a stored block to `events`: to the last `BlockStored` when it continues that event's chain in the same
    medium, else as a new one."""
    last = events[-1] if events else None
    if isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent:
        if last.medium == medium:
            last.block_hashes.append(h)
            last.token_ids.extend(tokens)
            return
    events.append(
        BlockStored(
            block_hashes=[h],
            parent_block_hash=parent,
            token_ids=list(tokens),
            block_size=block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )
    )
