"""KV events from a real engine: a subscriber rebuilds the prefix cache's block set from the stream.

A random workload with shared prefixes, two tenants, agent sessions, aborts, evictions (a 24-block pool)
and an injected device fault runs on the tiny model; a subscriber that was listening from the start and
one that joined halfway (and replays what it missed) must both end with exactly the engine's indexed
blocks, from gapless sequence numbers, and every stored block must hash to what its tokens say.
"""

from __future__ import annotations

import random
import time

import pytest

from helexa.cluster import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from helexa.engine.engine import Engine
from helexa.kvcache.prefix import block_hash, root_hash
from helexa.model.sampling import SamplingParams
from tests.cluster.subscriber import Subscriber, raw, rebuild
from tests.support.engines import assert_released, cpu_config, run_streams

BS = 4
SALTS = (None, "tenant-a")
TOPIC = "kv@10.0.0.7:8000@tiny"


def _engine(model_dir, **overrides) -> Engine:
    args = dict(
        num_blocks=24, block_size=BS, max_num_batched_tokens=64, max_num_seqs=4, max_wait_secs=60.0,
        fault_backoff_secs=0.0, kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*",
        kv_events_topic=TOPIC,
    )  # fmt: skip
    return Engine(cpu_config(model_dir, **{**args, **overrides}))


def _wave(rng: random.Random, prefixes: list[list[int]], n: int) -> tuple[list, dict[int, int]]:
    requests, aborts = [], {}
    for i in range(n):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 400) for _ in range(rng.randint(0, 9))]
        params = SamplingParams(max_tokens=rng.randint(1, 8), temperature=0.0)
        requests.append((prompt, params, rng.choice(SALTS), rng.choice([None, "agent-1"])))
        if rng.random() < 0.25:
            aborts[i] = rng.randint(0, 10)
    return requests, aborts


def _run(engine: Engine, requests, aborts) -> None:
    handles = [engine.submit(p, sp, cache_salt=salt, prompt_cache_key=key) for p, sp, salt, key in requests]
    run_streams(engine, handles, aborts)


def _settle(engine: Engine) -> int:
    """Wait until the publisher has sent every batch it was given; returns the last sequence number."""
    assert engine.kv_events is not None and engine.kv_events.publisher.flush(10.0)
    return engine.kv_events.published - 1


def _check_chain(stored: BlockStored) -> None:
    """The hashes are what the tokens say: the first block's parent is the root of one of the tenants' chains."""
    parents = [stored.parent_block_hash] if stored.parent_block_hash is not None else [root_hash(s) for s in SALTS]
    chunks = [stored.token_ids[i : i + BS] for i in range(0, len(stored.token_ids), BS)]
    assert any(block_hash(parent, chunks[0]) == stored.block_hashes[0] for parent in parents)
    for prev, h, chunk in zip(stored.block_hashes, stored.block_hashes[1:], chunks[1:]):
        assert block_hash(prev, chunk) == h


def test_a_subscriber_rebuilds_exactly_the_engines_cached_blocks(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setenv("HELEXA_FAULT_INJECT", "9")  # a device fault in the first wave: reload, replay
    engine = _engine(tiny_model_dir)
    assert engine.kv_events is not None
    early = Subscriber(engine.kv_events.publisher.endpoint, engine.kv_events.publisher.replay_endpoint, b"kv@")
    late = None
    try:
        rng = random.Random(7)
        prefixes = [[rng.randrange(3, 400) for _ in range(n)] for n in (12, 9, 16)]
        for wave in range(3):
            if wave == 2:  # joins halfway: everything before must come from the replay buffer
                late = Subscriber(engine.kv_events.publisher.endpoint, engine.kv_events.publisher.replay_endpoint)
            requests, aborts = _wave(rng, prefixes, 6)
            _run(engine, requests, aborts)
        assert_released(engine)
        last = _settle(engine)
        cache = engine.kv.prefix_cache
        assert engine.counters.model_reloads == 1 and engine.counters.prefix_cache_evictions > 0
        assert engine.counters.prefix_cache_hit_tokens > 0
        expected = {node.hash for node in cache.indexed_blocks()}
        assert expected and len(expected) == cache.num_indexed == cache.counts().cached

        early.receive(last)
        live = sorted(early.live)
        assert live == list(range(live[0], last + 1))  # gapless from the first message it saw
        assert early.topics == {TOPIC.encode()}
        replayed = early.replay(0)
        assert sorted(replayed) == list(range(last + 1))  # the buffer holds it all (10,000 batches)
        assert all(replayed[s] == early.live[s] for s in live)  # the same bytes as sent live
        blocks = rebuild({**replayed, **early.live})
        assert blocks.hashes == expected
        assert blocks.removed > 0 and blocks.cleared == 2  # at start, and at the reload
        for stored in blocks.stored:
            _check_chain(stored)

        assert late is not None
        late.receive(last)
        missed = early.replay(0).keys() - late.live.keys()
        assert missed and min(late.live) > 0
        assert rebuild({**late.replay(0), **late.live}).hashes == expected

        first = decode_batch(replayed[0])
        assert first.events == [AllBlocksCleared()] and first.data_parallel_rank == 0
        reload = next(s for s in range(1, last + 1) if AllBlocksCleared() in decode_batch(replayed[s]).events)
        events = decode_batch(replayed[reload]).events  # the dropped pool's blocks, one by one, then the clear
        assert isinstance(events[-1], AllBlocksCleared) and any(isinstance(e, BlockRemoved) for e in events)
    finally:
        early.close()
        if late is not None:
            late.close()
        engine.shutdown()


def test_the_wire_carries_vllms_positional_layout(tiny_model_dir) -> None:
    """Frames (topic, 8-byte big-endian seq, msgpack), and the payload as positional arrays, field by field."""
    engine = _engine(tiny_model_dir, num_blocks=64)
    assert engine.kv_events is not None
    sub = Subscriber(engine.kv_events.publisher.endpoint, engine.kv_events.publisher.replay_endpoint)
    try:
        sub.wait_joined()  # this test reads the run's last batch live
        prompt = list(range(10, 31))  # 5 full blocks of 4 and one token more
        _run(engine, [(prompt, SamplingParams(max_tokens=3, temperature=0.0), None, None)], {})
        last = _settle(engine)
        sub.receive(last)
        payloads = {**sub.replay(0), **sub.live}
        batches = [raw(payloads[s]) for s in range(last + 1)]
        assert batches[0][1] == [["AllBlocksCleared"]]
        for ts, _events, rank in batches:
            assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
        stored = [e for _, events, _ in batches for e in events if e[0] == "BlockStored"]
        tag, hashes, parent, token_ids, block_size, lora_id, medium, lora_name = stored[0]
        # the pool of a CPU engine is host memory: its medium is "CPU" (on an accelerator, vLLM's "GPU")
        assert (tag, parent, block_size, lora_id, medium, lora_name) == ("BlockStored", None, BS, None, "CPU", None)
        assert token_ids == prompt[: len(hashes) * BS] and all(0 < h < 2**64 for h in hashes)
        # prompt + output = 23 tokens: the 5 full blocks the prompt and answer filled, chained from the root
        every = [h for e in stored for h in e[1]]
        assert every == [n.hash for n in engine.kv.prefix_cache.indexed_blocks()] and len(every) == 5
    finally:
        sub.close()
        engine.shutdown()


def test_with_the_prefix_cache_off_only_the_start_is_published(tiny_model_dir) -> None:
    engine = _engine(tiny_model_dir, prefix_cache=False)
    assert engine.kv_events is not None
    try:
        _run(engine, [([5, 6, 7, 8, 9, 10, 11, 12, 13], SamplingParams(max_tokens=2, temperature=0.0), None, None)], {})
        assert _settle(engine) == 0 and engine.kv_events.dropped == 0
    finally:
        engine.shutdown()
    assert engine.kv_events.publisher.published == 1


def test_an_unbindable_endpoint_fails_the_load_with_its_address(tiny_model_dir) -> None:
    first = _engine(tiny_model_dir, kv_events_replay_endpoint=None)
    assert first.kv_events is not None
    taken = first.kv_events.publisher.endpoint.replace("127.0.0.1", "*")
    try:
        with pytest.raises(OSError, match="kv events: cannot bind"):
            _engine(tiny_model_dir, kv_events_endpoint=taken, kv_events_replay_endpoint=None)
    finally:
        first.shutdown()
