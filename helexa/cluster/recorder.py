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
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self._clock = clock
        self._lock = Lock()  # guards _pending (the cache's lock, when taken, is taken first)
        self._pending: list[Event] = []
        self._cache: PrefixCache | None = None
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
            "kv events: publishing on %s (replay: %s) topic=%r block_size=%d encoding=%s",
            publisher.endpoint, publisher.replay_endpoint or "off", topic, block_size,
            "map" if tagged_maps else "array",
        )  # fmt: skip
        return cls(publisher, block_size)

    # ------------------------------------------------------------------ engine

    def start(self, cache: PrefixCache | None) -> None:
        """Listen to `cache` (None: the prefix cache is off) and publish `AllBlocksCleared`: nothing is cached yet."""
        self.attach(cache)
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
        with cache.lock:
            nodes = cache.indexed_blocks()
            cache.set_listener(None)
            with self._lock:
                if nodes:
                    self._removed(nodes)
                self._pending.append(AllBlocksCleared())
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
            _append_stored(self._pending, node, self.block_size)

    def blocks_removed(self, nodes: Sequence[CachedBlock]) -> None:
        with self._lock:
            self._removed(nodes)

    def all_cleared(self) -> None:
        with self._lock:
            self._pending.append(AllBlocksCleared())

    # ------------------------------------------------------------------ internals

    def _removed(self, nodes: Sequence[CachedBlock]) -> None:
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.extend(node.hash for node in nodes)
        else:
            self._pending.append(BlockRemoved(block_hashes=[node.hash for node in nodes], medium=MEDIUM))

    def _batch(self, events: list[Event]) -> KVEventBatch:
        return KVEventBatch(ts=self._clock(), events=events, data_parallel_rank=self.data_parallel_rank)

    def _publish_resync(self) -> None:
        """While the queue is full, drop the step's events (the resync will cover them); once it has room,
        publish `AllBlocksCleared` + every indexed block, from one reading of the cache."""
        cache = self._cache
        guard: AbstractContextManager = cache.lock if cache is not None else nullcontext()
        with guard, self._lock:
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
                _append_stored(events, node, self.block_size)
            if not self.publisher.publish(self._batch(events)):
                return
            self._resync = False
            dropped, self._dropped_since_resync = self._dropped_since_resync, 0
        logger.warning(
            "kv events: resynced after %d dropped batches: AllBlocksCleared + %d blocks", dropped, len(nodes)
        )


def _append_stored(events: list[Event], node: CachedBlock, block_size: int) -> None:
    """Add `node` to `events`: to the last `BlockStored` when `node` continues its chain, else as a new one."""
    parent = node.parent.hash if node.parent is not None else None
    last = events[-1] if events else None
    if isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent:
        last.block_hashes.append(node.hash)
        last.token_ids.extend(node.tokens)
        return
    events.append(
        BlockStored(
            block_hashes=[node.hash],
            parent_block_hash=parent,
            token_ids=list(node.tokens),
            block_size=block_size,
            lora_id=None,
            medium=MEDIUM,
            lora_name=None,
        )
    )
