"""The tiers below the pool on their own: exact drop order, demotion, verification, restart, identity, events."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from helexa.cluster.events import BlockRemoved, BlockStored
from helexa.cluster.recorder import KVEventRecorder
from helexa.kvcache import BlockPool, KVManager, block_hash, root_hash
from helexa.kvcache.tiers import KVIdentity, KVTiers, TierBlock, TierIndex
from helexa.kvprotocol import Share

BS = 4


class Collect:
    def __init__(self) -> None:
        self.batches: list = []

    def publish(self, batch) -> bool:
        self.batches.append(batch)
        return True

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _pool(num_blocks: int = 6) -> BlockPool:
    return BlockPool(num_blocks, BS, 2, 1, 2, torch.float32, "cpu", backend="torch")


def _manager(pool: BlockPool, tiers: KVTiers, clock: Clock) -> KVManager:
    return KVManager(pool, max_num_seqs=4, max_model_len=64, tiers=tiers, retention_secs=100.0, clock=clock)


def _turn(kv: KVManager, pool: BlockPool, key: str, tokens: list[int], session: str | None = None) -> int:
    """One request over `tokens`: its hit (pool, then tiers), then "compute" the rest: every slot's K is the token
    id, V its negation. Checks that every position of its table holds its own token's K/V; returns the hit."""
    kv.open(key, tokens, session=session)
    assert kv.pin(key, kv.lookup(key))
    done = kv.start(key, tokens)
    done += kv.load_from_tiers(key, 100)
    attn = kv.build_step([(key, len(tokens) - done)])
    for i, slot in enumerate(attn.slot_mapping.tolist()):
        for layer in range(pool.num_layers):
            pool.k_cache(layer).view(-1, 1, 2)[slot] = float(tokens[done + i] + layer)
            pool.v_cache(layer).view(-1, 1, 2)[slot] = -float(tokens[done + i])
    kv.offer(key, len(tokens))
    ids = kv.holding(key).block_ids
    for pos, tok in enumerate(tokens):
        block, off = ids[pos // BS], pos % BS
        assert pool.k_cache(1)[block, off, 0, 0].item() == tok + 1 and pool.v_cache(0)[block, off, 0, 1] == -tok
    kv.drop_table(key)
    kv.let_go(key)
    kv.close(key)
    kv.check_integrity()
    return done


def test_a_tier_drops_unretained_blocks_first_then_retained_oldest_first() -> None:
    index = TierIndex(capacity_bytes=30)

    def block(h: int, retained: bool) -> TierBlock:
        return TierBlock(h, 0, True, (h,), 10, retain_until=2000.0 if retained else 0.0)

    r0, r1, p2, p3, r4, r5 = (
        block(0, True),
        block(1, True),
        block(2, False),
        block(3, False),
        block(4, True),
        block(5, True),
    )
    assert [index.add(b, 1000.0) for b in (r0, r1, p2)] == [[], [], []]
    assert index.add(p3, 1000.0) == [p2]  # the un-retained one, though the retained ones are older
    index.touch(r0, 0.0, 1000.0)  # used again: the newest of the retained
    assert index.add(r4, 1000.0) == [p3]  # un-retained blocks go first, whatever their age
    assert index.add(r5, 1000.0) == [r1]  # then retained ones, least recently used first
    p6 = block(6, False)
    assert index.add(p6, 3000.0) == [r0]  # their retention ran out: expired retained blocks go first
    big = TierBlock(9, 0, True, (9,), 31)
    assert index.add(big, 1000.0) == [big]  # never fits: not added, nothing dropped
    index.check_integrity()
    assert index.nbytes == 30 and len(index) == 3


def test_evicted_blocks_go_down_host_then_disk_and_come_back_exact(tmp_path: Path) -> None:
    pool, clock = _pool(), Clock()
    identity = KVIdentity.of_pool(pool, "model-a")
    tiers = KVTiers(identity, host_bytes=2 * identity.payload_bytes, disk_path=tmp_path, clock=clock)
    kv = _manager(pool, tiers, clock)
    a, b = list(range(1, 18)), list(range(100, 117))  # 4 full blocks each, and one token more
    assert _turn(kv, pool, "a1", a) == 0
    # b needs 5 blocks, 2 are empty: a's last 3 leave the pool, tail first; host memory keeps 2 and hands its
    # oldest (a's last block) to the disk
    assert _turn(kv, pool, "b1", b) == 0
    host, disk = tiers.stats()
    assert (host.blocks, host.writes, host.drops) == (2, 3, 1) and (disk.blocks, disk.writes) == (1, 1)
    # admission's lookup sees the hit in the pool and the three blocks after it below, reading and counting nothing
    kv.open("peek", a)
    assert kv.lookup("peek") == Share(1, 0, 3) and tiers.load_seconds_per_block is None
    kv.close("peek")
    assert [(t.hits, t.loads) for t in tiers.stats()] == [(0, 0), (0, 0)]
    assert _turn(kv, pool, "a2", a) == 16  # a's first block from the pool, two from host memory, one from disk
    per_block = tiers.load_seconds_per_block
    assert per_block is not None and per_block == pytest.approx(tiers.load_seconds / 3)
    host, disk = tiers.stats()
    assert (host.hits, host.loads, disk.hits, disk.loads) == (2, 2, 1, 1) and host.failures == disk.failures == 0
    tiers.check_integrity()
    tiers.close()


def test_a_damaged_or_truncated_file_is_a_miss_and_a_changed_identity_discards_the_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool, clock = _pool(), Clock()
    identity = KVIdentity.of_pool(pool, "model-a")
    tiers = KVTiers(identity, disk_path=tmp_path, clock=clock)
    kv = _manager(pool, tiers, clock)
    a = list(range(1, 18))
    _turn(kv, pool, "a1", a)
    kv.prefix_cache.ensure_free(pool.num_blocks)  # every cached block goes to disk
    assert tiers.flush()
    files = {f.name: f for f in (tmp_path / "blocks").glob("*.kvb")}
    assert len(files) == 4
    parent, hashes = root_hash(None), []
    for i in range(4):
        parent = block_hash(parent, a[i * BS : (i + 1) * BS])
        hashes.append(parent)
    third = files[f"{hashes[2]:016x}.kvb"]
    data = bytearray(third.read_bytes())
    data[-1] ^= 0x40  # one bit of the payload
    third.write_bytes(bytes(data))
    assert _turn(kv, pool, "a2", a) == 8  # the chain stops at the damaged block: computed again, never loaded
    assert tiers.flush()  # the writer thread deletes a dropped block's file
    assert tiers.stats()[0].failures == 1 and not third.exists()
    kv.prefix_cache.ensure_free(pool.num_blocks)
    assert tiers.flush()
    second = tmp_path / "blocks" / f"{hashes[1]:016x}.kvb"
    second.write_bytes(second.read_bytes()[:-10])  # truncated
    tiers.close()
    restarted = KVTiers(identity, disk_path=tmp_path, clock=clock)  # a restart: the truncated file is refused
    assert restarted.stats()[0].blocks == 3
    kv = _manager(pool, restarted, clock)
    kv.reset(pool)
    assert _turn(kv, pool, "a3", a) == 4  # block 0 loaded; block 1 was the truncated one
    restarted.close()
    with caplog.at_level(logging.WARNING, logger="helexa.kvcache"):
        other = KVTiers(KVIdentity.of_pool(pool, "model-b"), disk_path=tmp_path, clock=clock)
    assert other.stats()[0].blocks == 0 and not list((tmp_path / "blocks").glob("*.kvb"))
    assert "was written for another model" in caplog.text
    other.close()


def test_a_failed_write_is_dropped_with_a_removal_event(tmp_path: Path) -> None:
    pool, clock = _pool(), Clock()
    identity = KVIdentity.of_pool(pool, "model-a")
    tiers = KVTiers(identity, disk_path=tmp_path, clock=clock)
    disk = tiers.tiers[0]

    def failing(path, data):
        raise OSError("disk full")

    disk._write_file = failing
    publisher = Collect()
    recorder = KVEventRecorder(publisher, BS)  # type: ignore[arg-type]
    kv = _manager(pool, tiers, clock)
    recorder.start(kv.prefix_cache, tiers)
    _turn(kv, pool, "a1", list(range(1, 10)))  # blocks 0, 1 indexed
    kv.prefix_cache.ensure_free(pool.num_blocks)
    assert tiers.flush()
    recorder.end_step()
    events = [e for b in publisher.batches for e in b.events]
    kinds = [(type(e).__name__, getattr(e, "medium", None)) for e in events if not type(e).__name__.startswith("All")]
    # stored in the pool; removed from it (tail first) before stored on disk; then the failed writes remove them
    assert kinds == [("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "DISK"),
                     ("BlockStored", "DISK"), ("BlockRemoved", "DISK")]  # fmt: skip
    stored_pool = events[1]
    assert isinstance(stored_pool, BlockStored)
    removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "DISK" for h in e.block_hashes]
    assert sorted(removed) == sorted(stored_pool.block_hashes)
    assert tiers.stats()[0].blocks == 0 and tiers.stats()[0].failures == 2
    recorder.close()
    tiers.close()


def test_tier_flags_need_a_directory_and_a_tier() -> None:
    identity = KVIdentity("m", "float32", BS, 1, 1, 2)
    with pytest.raises(ValueError, match="needs a host tier"):
        KVTiers(identity)
    with pytest.raises(ValueError, match="needs its directory"):
        KVTiers(identity, host_bytes=1 << 20, disk_bytes=1 << 20)
