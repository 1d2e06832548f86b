"""The publisher and recorder without a model: never blocking, drop-and-count, resync, replay, stable hashes."""

from __future__ import annotations

import hashlib
import threading
import time

import msgspec
import pytest
import zmq

from helexa.cluster import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventRecorder,
    binds,
    decode_batch,
    encode_batch,
)
from helexa.config import EngineConfig
from helexa.kvcache import BlockAllocator, PrefixCache
from helexa.kvcache.prefix import block_hash, root_hash
from tests.cluster.subscriber import Subscriber, rebuild

BS = 4
LOOPBACK = "tcp://127.0.0.1:*"


def _cache(num_blocks: int = 16) -> tuple[BlockAllocator, PrefixCache]:
    allocator = BlockAllocator(num_blocks, "cpu")
    return allocator, PrefixCache(allocator, BS)


def _compute(allocator: BlockAllocator, cache: PrefixCache, tokens: list[int], owner: str) -> list[int]:
    """A sequence takes its cached prefix, computes and offers the rest of its full blocks, then ends (its blocks
    stay cached); returns the blocks it held through the cache."""
    hit = cache.acquire(tokens + [0], owner)  # (a sequence always computes at least one token itself)
    held, parent = list(hit.block_ids), (hit.nodes[-1] if hit.nodes else None)
    new = len(tokens) // BS - len(held)
    cache.ensure_free(new)
    for i, b in enumerate(allocator.allocate(new).tolist(), start=len(held)):
        node = cache.insert(b, tokens[i * BS : (i + 1) * BS], parent, owner)
        assert node is not None and node.block_id == b
        held.append(b)
        parent = node
    cache.release(held, owner)
    return held


def _settle(publisher: KVEventPublisher) -> int:
    """Wait until every batch published so far was sent; the last sequence number."""
    assert publisher.flush(10.0)
    return publisher.published - 1


def test_a_full_queue_drops_and_counts_never_blocks_and_a_resync_restores_the_set() -> None:
    publisher = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, queue_batches=2)  # not started: nothing drains
    recorder = KVEventRecorder(publisher, BS)
    allocator, cache = _cache()
    recorder.start(cache)  # batch 1 of 2: AllBlocksCleared
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint)
    try:

        def steps() -> None:  # 8 steps of stores (and, as the pool fills, evictions): 1 fits, 7 are dropped
            for step in range(8):
                _compute(allocator, cache, [step * 10 + i for i in range(8)], f"r{step}")
                recorder.end_step()

        stepping = threading.Thread(target=steps, daemon=True)
        stepping.start()
        stepping.join(timeout=60)  # nothing drains the queue: a step that waited for room would never return
        assert not stepping.is_alive(), "end_step blocked on a full queue"
        assert publisher.pending == 2 and recorder.dropped == 7 and publisher.published == 0
        publisher.start()
        assert _settle(publisher) == 1
        _compute(allocator, cache, [900, 901, 902, 903, 904], "after")
        recorder.end_step()  # room again: the resync (the step's own events are in it)
        last = _settle(publisher)
        assert last == 2 and recorder.dropped == 7
        # A SUB socket hears a PUB only once its subscription has reached it (ZMQ's "slow joiner"); on a loaded
        # machine that can be after these batches were sent, which is what the replay is for: it has them all.
        payloads = sub.replay(0)
        assert sorted(payloads) == [0, 1, 2]
        resync = decode_batch(payloads[2]).events
        assert resync[0] == AllBlocksCleared() and all(isinstance(e, BlockStored) for e in resync[1:])
        assert rebuild(payloads).hashes == {n.hash for n in cache.indexed_blocks()}
        assert cache.evictions > 0
        # And the stream goes on incrementally, live: steps until the subscriber has joined and heard one.
        for step in range(100):
            _compute(allocator, cache, [1000 + 10 * step + i for i in range(8)], f"later{step}")
            recorder.end_step()
            last = _settle(publisher)
            if sub.sock.poll(100):
                break
        sub.receive(last)
        assert recorder.dropped == 7 and sub.live
        assert rebuild({**sub.replay(0), **sub.live}).hashes == {n.hash for n in cache.indexed_blocks()}
    finally:
        sub.close()
        recorder.close()


class Collect:
    """A publisher that keeps what it is given (the recorder's side alone)."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []
        self.pending, self.capacity, self.published, self.dropped = 0, 1, 0, 0

    def publish(self, batch: KVEventBatch) -> bool:
        self.batches.append(batch)
        return True

    def close(self) -> None:
        pass


def test_stores_of_one_chain_share_an_event_and_removals_follow_in_order() -> None:
    publisher = Collect()
    recorder = KVEventRecorder(publisher, BS, clock=lambda: 123.0)  # type: ignore[arg-type]
    allocator, cache = _cache(num_blocks=4)
    recorder.attach(cache)
    _compute(allocator, cache, list(range(12)), "a")  # 3 blocks of one chain
    _compute(allocator, cache, list(range(8)) + list(range(77, 85)), "b")  # shares 2 blocks, evicts 1, adds 2
    recorder.end_step()
    recorder.end_step()  # nothing new: no batch
    (batch,) = publisher.batches
    first, removed, second = batch.events
    assert isinstance(first, BlockStored) and isinstance(removed, BlockRemoved) and isinstance(second, BlockStored)
    assert first.parent_block_hash is None and first.token_ids == list(range(12)) and len(first.block_hashes) == 3
    assert removed.block_hashes == [first.block_hashes[2]]  # the LRU one: the chain's last block
    assert second.parent_block_hash == first.block_hashes[1] and second.token_ids == list(range(77, 85))
    assert len(second.block_hashes) == 2
    assert (batch.ts, batch.data_parallel_rank) == (123.0, 0)
    recorder.close()


def test_clearing_the_cache_removes_each_block_then_clears() -> None:
    publisher = Collect()
    recorder = KVEventRecorder(publisher, BS)  # type: ignore[arg-type]
    allocator, cache = _cache()
    recorder.attach(cache)
    held = _compute(allocator, cache, list(range(8)), "a")
    assert cache.clear() == len(held) == 2
    recorder.end_step()
    stored, removed, cleared = publisher.batches[0].events
    # evicted from the chain's tail back to its head
    assert isinstance(stored, BlockStored) and removed == BlockRemoved(stored.block_hashes[::-1], "GPU")
    assert cleared == AllBlocksCleared()
    recorder.close()


def test_replay_from_any_point_and_bad_requests_are_ignored() -> None:
    publisher = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, topic="kv@a@m", buffer_batches=3)
    publisher.start()
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint)
    try:
        for i in range(5):
            assert publisher.publish(KVEventBatch(float(i), [BlockRemoved([i + 1], "GPU")], 0))
        assert _settle(publisher) == 4
        assert sorted(sub.replay(0)) == [2, 3, 4]  # the buffer keeps the last 3
        assert sorted(sub.replay(4)) == [4] and sub.replay(99) == {}
        assert decode_batch(sub.replay(3)[3]).events == [BlockRemoved([4], "GPU")]
        bad = zmq.Context.instance().socket(zmq.DEALER)
        bad.connect(publisher.replay_endpoint)
        bad.send_multipart([b"", b"\x01"])  # not 8 bytes: ignored, and the publisher goes on
        time.sleep(0.1)
        bad.close(linger=0)
        assert sorted(sub.replay(3)) == [3, 4]
    finally:
        sub.close()
        publisher.close()
    assert not publisher.publish(KVEventBatch(0.0, [], 0)) and publisher.dropped == 1  # closed: dropped, counted


def test_encoding_round_trips_and_endpoints_bind_or_connect_by_vllms_rule() -> None:
    batch = KVEventBatch(
        1.5, [BlockStored([2**64 - 1, 5], None, list(range(8)), 4, None, "GPU", None), AllBlocksCleared()], 0
    )
    assert decode_batch(encode_batch(batch)) == batch
    assert binds("tcp://*:5557") and binds("tcp://127.0.0.1:*") and binds("ipc:///tmp/x") and binds("tcp://[::]:1")
    assert not binds("tcp://epp.ns.svc.cluster.local:5557")
    with pytest.raises(ValueError, match="kv_events_endpoint"):
        EngineConfig(kv_events_endpoint="http://x:1")
    with pytest.raises(ValueError, match="needs --kv-events-endpoint"):
        EngineConfig(kv_events_replay_endpoint="tcp://*:5558")


def test_block_hashes_are_sha256_and_the_same_in_every_process() -> None:
    root = root_hash(None)
    expected = hashlib.sha256(root.to_bytes(8, "big") + b"".join(t.to_bytes(8, "little") for t in (1, 2, 3, 4)))
    assert block_hash(root, (1, 2, 3, 4)) == int.from_bytes(expected.digest()[-8:], "big")
    assert len({root_hash(None), root_hash("a"), root_hash("b"), root_hash("")}) == 4
    # Fixed values: Python's salted hash() would give others in every process (and did, before).
    assert (root_hash(None), root_hash("t")) == (0x4B6E096511A36B5E, 0x8C46A8BD3917C399)
    assert block_hash(root_hash("t"), [7, 8, 9, 10]) == 0x627B917A66D57994


def test_tagged_maps_are_vllms_newer_encoding_and_replays_carry_the_topic() -> None:
    """`--kv-events-encoding map`: each event a map tagged by `type` (every field written), the batch still
    `[ts, events, rank]`; a replay reply is `[b"", topic, seq, payload]` (what vllm-router reads)."""
    stored = BlockStored([7, 8], 6, list(range(8)), 4, None, "GPU", None)
    batch = KVEventBatch(2.5, [stored, BlockRemoved([7], "GPU"), AllBlocksCleared()], 0)
    raw = msgspec.msgpack.decode(encode_batch(batch, tagged_maps=True))
    assert raw[0] == 2.5 and raw[2] == 0
    assert raw[1][0] == {
        "type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": 6, "token_ids": list(range(8)),
        "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None,
    }  # fmt: skip
    assert raw[1][1:] == [{"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}, {"type": "AllBlocksCleared"}]
    assert decode_batch(encode_batch(batch, tagged_maps=True)) == batch
    with pytest.raises(msgspec.ValidationError):
        decode_batch(msgspec.msgpack.encode([1.0, [{"type": "Nope"}], 0]))
    with pytest.raises(ValueError, match="kv_events_encoding"):
        EngineConfig(kv_events_encoding="json")

    publisher = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, topic="kv", tagged_maps=True)
    publisher.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        assert publisher.publish(batch)
        assert _settle(publisher) == 0
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.poll(10_000)
        empty, topic, seq, payload = dealer.recv_multipart()
        assert (empty, topic, int.from_bytes(seq, "big")) == (b"", b"kv", 0)
        assert decode_batch(payload) == batch
        assert dealer.poll(10_000)
        assert dealer.recv_multipart() == [b"", b"kv", END_OF_REPLAY, b""]
    finally:
        dealer.close()
        publisher.close()


def test_a_loopback_endpoint_is_bound_on_a_fixed_port_that_survives_a_restart() -> None:
    """`tcp://127.0.0.1:PORT` binds (a router on this host connects to it); a publisher restarted on the same
    port is reached again by the subscriber that was connected before."""
    assert binds("tcp://127.0.0.1:5557") and binds("tcp://localhost:5557") and binds("tcp://[::1]:5557")
    first = KVEventPublisher(LOOPBACK)
    port = int(first.endpoint.rsplit(":", 1)[1])
    first.close()
    fixed = f"tcp://127.0.0.1:{port}"
    sub = Subscriber(fixed)
    try:
        for ts in (1.0, 2.0):  # the replica, then the replica restarted
            publisher = _bind_when_free(fixed)
            publisher.start()
            try:
                deadline = time.monotonic() + 10
                while not sub.sock.poll(50) and time.monotonic() < deadline:  # the SUB (re)connects, then receives
                    publisher.publish(KVEventBatch(ts, [AllBlocksCleared()], 0))
                    publisher.flush(5.0)
                topic, seq, payload = sub.sock.recv_multipart()
                assert decode_batch(payload).ts == ts
                while sub.sock.poll(100):
                    sub.sock.recv_multipart()
            finally:
                publisher.close()
    finally:
        sub.close()


def _bind_when_free(endpoint: str) -> KVEventPublisher:
    """A publisher on `endpoint`, once ZMQ's I/O thread has let the previous one's listener go (closing a
    socket is asynchronous in ZMQ; a restarted process finds its dead predecessor's port free at once)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return KVEventPublisher(endpoint)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
