"""The KV owner on CPU: exact block ids, counts and charges through a request's whole life, sharing and orphans,
check/commit pins, reloads, and random operations that keep every invariant."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helexa.kvcache import BlockPool, BlockStates, KVManager
from helexa.kvprotocol import Share

BS = 4


def _kv(num_blocks: int = 16, prefix_cache: bool = True, max_num_seqs: int = 4) -> KVManager:
    pool = BlockPool(num_blocks, BS, 1, 1, 4, torch.float32, "cpu", backend="torch")
    return KVManager(pool, max_num_seqs=max_num_seqs, max_model_len=64, prefix_cache=prefix_cache)


def _run(kv: KVManager, key: str, tokens: list[int], *, steps: list[int] | None = None) -> list[int]:
    """Grant (lookup + pin), start and compute `tokens` in `steps` chunks (default: all at once), offering as it
    goes. Returns the sequence's token list (the one the KV owner reads)."""
    share = kv.lookup(key)
    assert kv.pin(key, share)
    seq = list(tokens)
    done = kv.start(key, seq)
    for n in steps or [len(tokens) - done]:
        kv.build_step([(key, n)])
        done += n
        kv.offer(key, done)
        kv.check_integrity()
    return seq


def _end(kv: KVManager, key: str) -> None:
    kv.drop_table(key)
    kv.let_go(key)
    kv.close(key)
    kv.check_integrity()


def test_one_request_from_grant_to_close() -> None:
    kv = _kv()
    prompt = list(range(10))  # two full blocks and two tokens
    kv.open("a", prompt, session=None)
    assert kv.lookup("a") == Share(0, 0)
    _run(kv, "a", prompt)
    assert kv.holding("a").block_ids == (0, 1, 2)
    assert (kv.charged_blocks("a"), kv.shared_blocks("a"), kv.offered_blocks("a")) == (3, 0, 2)
    assert kv.block_states() == BlockStates(empty=13, cached=0, in_use=3, retained=0)
    kv.drop_table("a")  # the partial block is its own: free at once; the full ones wait for the reservation
    assert kv.block_states() == BlockStates(empty=14, cached=0, in_use=2, retained=0)
    assert kv.charged_blocks("a") == 2 and kv.holding("a").block_ids == (0, 1)
    with pytest.raises(ValueError, match="still holds 2 blocks"):
        kv.close("a")
    kv.let_go("a")
    assert kv.block_states() == BlockStates(empty=14, cached=2, in_use=0, retained=0)
    kv.close("a")
    assert kv.keys() == []
    kv.check_integrity()


def test_a_second_request_shares_the_running_prefix_and_the_first_leaves_orphans() -> None:
    kv = _kv()
    prompt = list(range(12))
    kv.open("a", prompt)
    _run(kv, "a", prompt)  # blocks 0, 1, 2: all full, all offered
    kv.open("b", prompt + [99])
    assert kv.lookup("b") == Share(hit_blocks=3, shared_blocks=3)
    _run(kv, "b", prompt + [99])
    assert kv.holding("b").block_ids == (0, 1, 2, 3)
    assert (kv.charged_blocks("b"), kv.shared_blocks("b"), kv.orphan_blocks()) == (1, 3, 0)
    _end(kv, "a")  # a's three blocks stay in use for b, charged to nobody
    assert kv.orphan_blocks() == 3 and kv.block_states() == BlockStates(12, 0, 4, 0)
    _end(kv, "b")  # its partial block 3 is free again; the three full ones cached
    assert kv.orphan_blocks() == 0 and kv.block_states() == BlockStates(empty=13, cached=3, in_use=0, retained=0)


def test_a_pin_checks_what_its_lookup_saw() -> None:
    kv = _kv()
    prompt = list(range(9))
    kv.open("a", prompt)
    _run(kv, "a", prompt)
    _end(kv, "a")  # blocks 0, 1 cached
    kv.open("b", prompt)
    stale = kv.lookup("b")
    assert stale == Share(2, 0)
    kv.open("c", prompt)
    assert kv.pin("c", kv.lookup("c"))  # c takes them meanwhile: now they are in use
    assert not kv.pin("b", stale) and kv.holding("b").block_ids == ()  # b pins nothing; admission looks again
    fresh = kv.lookup("b")
    assert fresh == Share(2, 2) and kv.pin("b", fresh)
    assert (kv.charged_blocks("b"), kv.charged_blocks("c")) == (0, 2)
    kv.check_integrity()


def test_sessions_retain_their_blocks_past_the_lru_ones() -> None:
    kv = _kv(num_blocks=6)
    for key, base, session in (("agent", 0, "s1"), ("other", 100, None)):
        prompt = list(range(base, base + 9))
        kv.open(key, prompt, session=session)
        _run(kv, key, prompt)
        _end(kv, key)
    assert kv.block_states() == BlockStates(empty=2, cached=4, in_use=0, retained=2)
    kv.open("big", list(range(200, 216)))
    _run(kv, "big", list(range(200, 216)))  # 4 blocks: both empty ones, then the LRU ones, not the session's
    assert kv.prefix_cache.survey().sessions == {"s1": [0, 1]}
    assert kv.evictions == 2
    _end(kv, "big")


def test_without_a_prefix_cache_every_block_is_a_tables() -> None:
    kv = _kv(prefix_cache=False)
    kv.open("a", list(range(9)))
    assert kv.lookup("a") == Share(0, 0) and kv.prefix_cache is None
    _run(kv, "a", list(range(9)))
    assert kv.block_states() == BlockStates(13, 0, 3, 0) and kv.charged_blocks("a") == 3
    _end(kv, "a")
    assert kv.block_states() == BlockStates(16, 0, 0, 0)


def test_reset_forgets_every_block_and_keeps_the_registrations() -> None:
    kv = _kv()
    prompt = list(range(9))
    kv.open("a", prompt)
    seq = _run(kv, "a", prompt)
    kv.reset(None)  # a device fault: no pool while the model reloads
    assert kv.block_states() == BlockStates(16, 0, 0, 0) and kv.lookup("a") == Share(0, 0)
    kv.check_integrity()
    with pytest.raises(RuntimeError, match="reloading"):
        kv.survey()
    kv.reset(BlockPool(16, BS, 1, 1, 4, torch.float32, "cpu", backend="torch"))
    assert kv.keys() == ["a"] and kv.charged_blocks("a") == 0
    assert kv.start("a", seq) == 0  # the replay computes everything again
    kv.build_step([("a", len(seq))])
    kv.offer("a", len(seq))
    assert kv.holding("a").block_ids == (0, 1, 2)
    _end(kv, "a")


def test_a_request_waits_for_the_one_prefilling_its_prompt() -> None:
    kv = _kv()
    prompt = list(range(16))
    kv.open("first", prompt)
    _run(kv, "first", prompt, steps=[4])  # one block computed of four
    kv.open("second", prompt)
    assert kv.source_for("second", ["first"]) == ("first", 3)  # all but the last token's block
    assert kv.source_for("second", []) is None
    kv.open("salted", prompt, salt="tenant-b")
    assert kv.source_for("salted", ["first"]) is None  # never across tenants


def test_check_integrity_sees_a_charge_no_holding_makes() -> None:
    kv = _kv()
    prompt = list(range(12))
    kv.open("a", prompt)
    _run(kv, "a", prompt)
    kv.open("b", prompt + [1])
    _run(kv, "b", prompt + [1])
    kv._holdings["b"].shared = 2  # b would be charged for a block a is charged for too
    with pytest.raises(RuntimeError, match="charged to requests"):
        kv.check_integrity()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_lives_keep_every_invariant_and_leak_nothing(data: st.DataObject) -> None:
    """Requests over three shared prefixes start, grow, end (or are preempted and resume) in any order; after
    every operation every block is charged once or orphaned, and at the end only cached blocks remain."""
    kv = _kv(num_blocks=24, max_num_seqs=4)
    prefixes = [list(range(8)), list(range(100, 108)), list(range(200, 212))]
    live: dict[str, list[int]] = {}  # running: key -> tokens
    waiting: dict[str, list[int]] = {}  # registered, holding nothing
    n = 0
    for _ in range(data.draw(st.integers(1, 30), label="ops")):
        op = data.draw(st.sampled_from(["open", "grow", "end", "preempt", "resume"]), label="op")
        if op == "open" and len(live) < 4:
            n += 1
            key = f"r{n}"
            tokens = prefixes[data.draw(st.integers(0, 2))] + data.draw(st.lists(st.integers(0, 50), max_size=6))
            kv.open(key, tokens, session=data.draw(st.sampled_from([None, "s"])))
            share = kv.lookup(key)
            needed = -(-len(tokens) // BS) - share.shared_blocks
            if needed > kv.block_states().empty + kv.block_states().cached or not kv.pin(key, share):
                kv.close(key)
                continue
            live[key] = tokens
            kv.build_step([(key, len(tokens) - kv.start(key, tokens))])
            kv.offer(key, len(tokens))
        elif op == "grow" and live:
            key = data.draw(st.sampled_from(sorted(live)))
            states = kv.block_states()
            if states.empty + states.cached >= 1 and len(live[key]) < 60:
                live[key].append(data.draw(st.integers(0, 50)))
                kv.build_step([(key, 1)])
                kv.offer(key, len(live[key]))
        elif op == "end" and live:
            key = data.draw(st.sampled_from(sorted(live)))
            del live[key]
            _end(kv, key)
        elif op == "preempt" and live:
            key = data.draw(st.sampled_from(sorted(live)))
            waiting[key] = live.pop(key)
            kv.drop_table(key)
            kv.let_go(key)
            assert kv.charged_blocks(key) == 0
        elif op == "resume" and waiting and len(live) < 4:
            key = data.draw(st.sampled_from(sorted(waiting)))
            share = kv.lookup(key)
            tokens = waiting[key]
            states = kv.block_states()
            if -(-len(tokens) // BS) - share.shared_blocks <= states.empty + states.cached and kv.pin(key, share):
                live[key] = waiting.pop(key)
                computed = kv.start(key, tokens)
                kv.build_step([(key, len(tokens) - computed)])
                kv.offer(key, len(tokens))
        kv.check_integrity()
    for key in list(live) + list(waiting):
        _end(kv, key)
    states = kv.block_states()
    assert states.in_use == 0 and kv.orphan_blocks() == 0 and kv.keys() == []
    assert states.empty + states.cached == 24
