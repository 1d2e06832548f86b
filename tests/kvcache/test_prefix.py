"""The prefix cache on its own: exact block ids, eviction order, retention, salts, charges, collisions."""

from __future__ import annotations

import doctest

import pytest

import helexa.kvcache.prefix as prefix_module
from helexa.kvcache import BlockAllocator, OutOfBlocks, PrefixCache

BS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _cache(num_blocks: int = 16, retention: float = 600.0) -> tuple[BlockAllocator, PrefixCache, Clock]:
    allocator = BlockAllocator(num_blocks, "cpu", backend="torch")
    clock = Clock()
    return allocator, PrefixCache(allocator, BS, retention_secs=retention, clock=clock), clock


def _compute(allocator: BlockAllocator, cache: PrefixCache, tokens: list[int], owner, salt=None) -> list[int]:
    """A sequence computes `tokens` into fresh blocks and offers its full ones; returns the blocks it holds
    through the cache (a duplicate block stays the sequence's own and is freed here)."""
    n = -(-len(tokens) // BS)
    ids = allocator.allocate(n).tolist()
    held, parent = [], None
    for i in range(len(tokens) // BS):
        node = cache.insert(ids[i], tokens[i * BS : (i + 1) * BS], parent, owner, salt=salt)
        assert node is not None
        if node.block_id == ids[i]:
            held.append(ids[i])
        parent = node
    allocator.free([b for b in ids if b not in held])
    return held


def test_docstring_example_runs() -> None:
    failures, tried = doctest.testmod(prefix_module)
    assert tried > 5 and failures == 0


def test_a_hit_is_the_longest_verified_run_and_leaves_the_last_token() -> None:
    allocator, cache, _ = _cache()
    prompt = list(range(100, 112))  # exactly 3 full blocks
    held = _compute(allocator, cache, prompt, "a")
    assert held == [0, 1, 2] and cache.counts() == (13, 0, 3, 0)
    cache.release(iter(held), "a")  # any iterable of ids
    assert cache.counts() == (13, 3, 0, 0)
    # the same 12 tokens again: the last one must be computed, so only 2 blocks are taken
    hit = cache.acquire(prompt, "b")
    assert hit is not None and hit.block_ids == (0, 1) and hit.num_tokens == 8 and hit.shared == 0
    # a prompt diverging inside block 1 finds block 0 only; held by "b" now, so it is shared
    hit2 = cache.acquire([*prompt[:5], 7, 7, 7, 7], "c")
    assert hit2 is not None and hit2.block_ids == (0,) and hit2.shared == 1
    assert cache.holders(0) == 2 and cache.holders(1) == 1 and cache.holders(2) == 0
    assert cache.acquire([1, 2, 3, 4, 5], "d").block_ids == ()  # nothing in common
    cache.check_integrity()


def test_an_expected_hit_that_changed_pins_nothing() -> None:
    allocator, cache, _ = _cache()
    cache.release(_compute(allocator, cache, list(range(9)), "a"), "a")
    assert cache.acquire(list(range(9)), "b", expect=(2, 1)) is None  # both blocks are cached, none in use
    assert cache.acquire(list(range(9)), "b", expect=(1, 0)) is None  # and two match, not one
    assert cache.counts().cached == 2
    assert cache.acquire(list(range(9)), "b", expect=(2, 0)).block_ids == (0, 1)
    cache.check_integrity()


def test_eviction_is_lru_among_cached_blocks_and_only_when_empty_blocks_run_out() -> None:
    allocator, cache, clock = _cache(num_blocks=6)
    a = _compute(allocator, cache, [1] * 4 + [2] * 4, "a")  # blocks 0, 1
    b = _compute(allocator, cache, [3] * 4, "b")  # block 2
    cache.release(b, "b")
    clock.t += 1
    cache.release(a, "a")  # released after b: more recently used
    assert cache.ensure_free(3) == 0  # 3 empty blocks are there: nothing evicted
    allocator.allocate(3)
    assert cache.ensure_free(1) == 1 and cache.node_of(2) is None  # b's block went first
    assert allocator.allocate(1).tolist() == [2]
    # a's chain goes from its tail: the head (block 0) stays a prefix a lookup can still reach
    assert cache.ensure_free(1) == 1 and cache.node_of(1) is None and cache.node_of(0) is not None
    with pytest.raises(OutOfBlocks):
        cache.ensure_free(3)  # 1 cached block cannot make 3 free
    assert cache.node_of(0) is not None  # and nothing was evicted trying
    cache.check_integrity()


def test_a_hit_block_in_use_is_never_evicted() -> None:
    allocator, cache, _ = _cache(num_blocks=3)
    cache.release(_compute(allocator, cache, [5] * 8 + [6], "a"), "a")  # blocks 0, 1 cached
    hit = cache.acquire([5] * 8 + [6], "b")
    assert hit.block_ids == (0, 1)
    with pytest.raises(OutOfBlocks):
        cache.ensure_free(2)
    assert cache.ensure_free(1) == 0  # the one empty block suffices


def test_parent_identity_guards_a_reused_block_id() -> None:
    """A child whose parent was evicted stays unreachable, even when the parent's content returns in a new block."""
    allocator, cache, _ = _cache(num_blocks=3)
    held = _compute(allocator, cache, [1] * 4 + [2] * 4, "a")  # parent 0, then child 1
    cache.release(held[:1], "a")  # the parent released first: it is evicted first
    cache.release(held[1:], "a")
    allocator.allocate(1)
    assert cache.ensure_free(1) == 1 and cache.node_of(0) is None and cache.node_of(1) is not None
    ids = allocator.allocate(1).tolist()  # block 0 again, now holding the parent's content anew
    assert ids == [0] and cache.insert(0, [1] * 4, None, "y") is not None
    hit = cache.acquire([1] * 4 + [2] * 4 + [0], "z")
    assert hit.block_ids == (0,)  # the old child (block 1) hangs off the evicted parent node: not served
    allocator.free([2])
    ids = allocator.allocate(1).tolist()  # "z" computes the child's content again and offers it
    node = cache.insert(ids[0], [2] * 4, cache.node_of(0), "z")
    assert node is cache.node_of(1) and node.parent is cache.node_of(0)  # equal chain: the old child is relinked
    allocator.free(ids)  # "z" keeps its duplicate block, and frees it
    assert cache.acquire([1] * 4 + [2] * 4 + [0], "w").block_ids == (0, 1)
    cache.check_integrity()


def test_salts_isolate_tenants() -> None:
    allocator, cache, _ = _cache()
    prompt = list(range(9))
    cache.release(_compute(allocator, cache, prompt, "a", salt="tenant-1"), "a")
    assert cache.acquire(prompt, "b").block_ids == ()
    assert cache.acquire(prompt, "c", salt="tenant-2").block_ids == ()
    assert cache.acquire(prompt, "d", salt="tenant-1").block_ids == (0, 1)


def test_orphans_are_counted_until_the_last_sharer_lets_go() -> None:
    allocator, cache, _ = _cache()
    held = _compute(allocator, cache, list(range(9)), "a")  # blocks 0, 1 charged to a
    hit = cache.acquire(list(range(9)), "b")  # in use by a: shared
    assert hit.shared == 2 and cache.orphan_blocks == 0
    cache.release(held, "a")  # b still holds them: charged to nobody now
    assert cache.orphan_blocks == 2 and cache.counts() == (14, 0, 2, 0)
    cache.check_integrity()
    cache.release(list(hit.block_ids), "b")
    assert cache.orphan_blocks == 0 and cache.counts() == (14, 2, 0, 0)
    # a cached block a new request takes is charged to it: releasing it leaves no orphan
    hit = cache.acquire(list(range(9)), "c")
    assert hit.shared == 0
    cache.release(list(hit.block_ids), "c")
    assert cache.orphan_blocks == 0
    cache.check_integrity()


def test_retained_blocks_are_evicted_after_unretained_ones_and_expire() -> None:
    allocator, cache, clock = _cache(num_blocks=6, retention=100.0)
    session = _compute(allocator, cache, [1] * 4 + [2] * 4, "s")  # blocks 0, 1
    other = _compute(allocator, cache, [3] * 4, "o")  # block 2
    cache.release(session, "s", session="agent-1")
    clock.t += 1
    cache.release(other, "o")  # more recently used than the session's blocks, but not retained
    assert cache.counts() == (3, 3, 0, 2)
    allocator.allocate(3)
    cache.ensure_free(1)
    assert cache.node_of(2) is None and cache.node_of(0) is not None  # the unretained block went first
    clock.t += 200  # retention ran out: the session's blocks are ordinary cached blocks again
    other = _compute(allocator, cache, [4] * 4, "p")
    cache.release(other, "p")
    cache.ensure_free(1)
    assert cache.node_of(1) is None  # expired retention (the chain's tail first) goes before a fresh unretained block
    cache.check_integrity()


def test_a_sessions_next_turn_drops_retention_of_what_it_no_longer_matches() -> None:
    allocator, cache, _ = _cache(num_blocks=5)
    turn1 = [1] * 4 + [2] * 4 + [3] * 4 + [9]
    cache.release(_compute(allocator, cache, turn1, "t1"), "t1", session="agent")  # 0, 1, 2 retained
    turn2 = [1] * 4 + [2] * 4 + [8] * 4 + [9]  # the conversation was edited after block 1
    hit = cache.acquire(turn2, "t2", session="agent")
    assert hit.block_ids == (0, 1) and cache.counts().retained == 0  # block 2 is plain cached now
    allocator.allocate(2)
    cache.ensure_free(1)
    assert cache.node_of(2) is None
    cache.check_integrity()


def test_a_hash_collision_never_shares_other_content(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_module, "block_hash", lambda parent, tokens: 42)  # every block hashes alike
    allocator, cache, _ = _cache()
    ids = allocator.allocate(2).tolist()
    first = cache.insert(ids[0], [1, 2, 3, 4], None, "a")
    assert first is not None
    assert cache.insert(ids[1], [5, 6, 7, 8], None, "b") is None  # other content, same hash: not indexed
    assert cache.acquire([5, 6, 7, 8, 9], "c").block_ids == ()  # and never served for it
    assert cache.acquire([1, 2, 3, 4, 9], "d").block_ids == (ids[0],)


def test_bad_calls_raise_and_change_nothing() -> None:
    allocator, cache, _ = _cache()
    ids = allocator.allocate(2).tolist()
    with pytest.raises(ValueError, match="holds 4 tokens"):
        cache.insert(ids[0], [1, 2, 3], None, "a")
    cache.insert(ids[0], [1, 2, 3, 4], None, "a")
    with pytest.raises(ValueError, match="already indexed"):
        cache.insert(ids[0], [1, 2, 3, 4], None, "a")
    with pytest.raises(ValueError, match="not an indexed block in use"):
        cache.release([ids[1]], "a")
    cache.release([ids[0]], "a")
    with pytest.raises(ValueError, match="not an indexed block in use"):
        cache.release([ids[0]], "a")
    with pytest.raises(ValueError):
        PrefixCache(allocator, BS, retention_secs=-1)
    cache.check_integrity()
