"""The KV tiers in the real engine: a session whose blocks left the pool loads them back from host memory or disk
and answers exactly as the run that never cached anything; faults and damaged files are misses, never wrong KV.

Every step checks every invariant (`Engine.check_integrity`: the pool's, the prefix cache's, admission's and the
tiers'), and every block a running sequence holds through the index holds exactly its tokens there.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helexa.engine.engine import Engine
from helexa.model.sampling import SamplingParams
from tests.support.engines import assert_released, cpu_config, run_streams, tokens

BS = 4
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
_REFERENCE: dict[tuple[int, ...], list[int]] = {}


def _engine(model_dir, **overrides) -> Engine:
    args = dict(num_blocks=14, block_size=BS, max_num_batched_tokens=64, max_wait_secs=60.0, max_num_seqs=3)
    return Engine(cpu_config(model_dir, **{**args, **overrides}))


def _check_hits(engine: Engine) -> None:
    cache = engine.kv.prefix_cache
    if cache is None:
        return
    for seq in engine._running:
        for i, block in enumerate(engine.kv.holding(seq.request_id).block_ids):
            node = cache.node_of(block)
            if node is not None:
                assert list(node.tokens) == seq.token_ids[i * BS : (i + 1) * BS]


def _turns(engine: Engine, prompts: list[list[int]], keys: list[str | None]) -> tuple[list[list[int]], list[int]]:
    """Run `prompts` together (session `keys`); their outputs and cached prompt tokens."""
    handles = [engine.submit(p, GREEDY, prompt_cache_key=k) for p, k in zip(prompts, keys)]
    events = run_streams(engine, handles, after_step=_check_hits)
    cached = [max((e.num_cached_tokens for e in events[h.request_id]), default=0) for h in handles]
    return [tokens(events[h.request_id]) for h in handles], cached


def _reference(reference_engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    missing = [p for p in prompts if tuple(p) not in _REFERENCE]
    if missing:
        for p, out in zip(missing, _turns(reference_engine, missing, [None] * len(missing))[0]):
            _REFERENCE[tuple(p)] = out
    return [_REFERENCE[tuple(p)] for p in prompts]


@pytest.fixture(scope="module")
def reference_engine(tiny_model_dir):
    """No prefix cache at all: every token computed."""
    return _engine(tiny_model_dir, num_blocks=64, prefix_cache=False)


def test_a_session_back_after_its_blocks_left_the_pool_loads_them_from_disk(
    tiny_model_dir, reference_engine, tmp_path
) -> None:
    engine = _engine(tiny_model_dir, kv_disk_path=str(tmp_path / "kv"), kv_disk_bytes=1 << 20)
    rng = random.Random(7)
    first = [rng.randrange(3, 400) for _ in range(25)]
    others = [[rng.randrange(3, 400) for _ in range(44)] for _ in range(2)]
    (out,), _ = _turns(engine, [first], ["agent"])
    for other in others:  # each needs 12 of the 14 blocks: the agent's retained blocks leave the pool
        _turns(engine, [other], [None])
    assert engine.kv.evictions > 0
    engine.kv.tiers.flush()
    second = first + out + [rng.randrange(3, 400) for _ in range(5)]
    (again,), (cached,) = _turns(engine, [second], ["agent"])
    assert again == _reference(reference_engine, [second])[0]
    computed = len(first) + len(out) - 1  # the first turn's last token was sampled, never computed
    assert cached == computed // BS * BS  # every full block it computed came back: from the pool or the disk
    disk = engine.snapshot()["kv_tiers"]["disk"]
    assert disk["loads"] > 0 and disk["failures"] == 0, disk
    assert engine.snapshot()["blocks_disk"] == disk["blocks"] > 0
    assert_released(engine)
    engine.shutdown()


def test_the_disk_tier_survives_a_restart_and_a_changed_model_discards_it(
    tiny_model_dir, reference_engine, tmp_path
) -> None:
    path = tmp_path / "kv"
    rng = random.Random(11)
    prompt = [rng.randrange(3, 400) for _ in range(30)]
    engine = _engine(tiny_model_dir, kv_disk_path=str(path))
    _turns(engine, [prompt], ["agent"])
    engine.kv.clear_cache()  # flushes the tiers too: nothing left
    assert engine.snapshot()["blocks_disk"] == 0
    _turns(engine, [prompt], ["agent"])
    engine.kv.prefix_cache.ensure_free(engine.pool.num_blocks)  # every cached block goes to disk
    engine.shutdown()  # the queued writes finish
    restarted = _engine(tiny_model_dir, kv_disk_path=str(path))
    assert restarted.snapshot()["blocks_disk"] == (len(prompt) + GREEDY.max_tokens - 1) // BS  # all it computed
    (out,), (cached,) = _turns(restarted, [prompt], ["agent"])
    assert out == _reference(reference_engine, [prompt])[0] and cached == (len(prompt) - 1) // BS * BS
    restarted.shutdown()
    other = _engine(tiny_model_dir, kv_disk_path=str(path), block_size=8)  # another block size: discarded
    assert other.snapshot()["blocks_disk"] == 0
    other.shutdown()


_turn = st.tuples(
    st.integers(0, 2),  # which session
    st.integers(1, 9),  # new tokens this turn
    st.booleans(),  # retained (prompt_cache_key) or not
)
_FAULTS = {"rng": random.Random(0), "write": 0.0, "read": 0.0}  # the current example's fault rates
PAYLOAD = 2 * 2 * BS * 2 * 16 * 4  # the tiny model's block: 2 layers, K and V, 2 KV heads of 16 float32
FILE = PAYLOAD + 117  # its file: the header and 4 token ids around it


@pytest.fixture(scope="module")
def tiered(tiny_model_dir, tmp_path_factory):
    """One engine for every example (its pool and tiers arrive warm and full from earlier ones): 14 pool blocks,
    a host tier of 6 and a disk tier of 12, whose file writes and reads fail at the example's rates."""
    path = tmp_path_factory.mktemp("tiers")
    engine = _engine(tiny_model_dir, kv_host_memory=6 * PAYLOAD, kv_disk_path=str(path), kv_disk_bytes=12 * FILE)
    disk = engine.kv.tiers.tiers[-1]
    real_write, real_read = disk._write_file, disk._read_file

    def flaky_write(p, data):
        if _FAULTS["rng"].random() < _FAULTS["write"]:
            raise OSError("injected write fault")
        real_write(p, data)

    def flaky_read(p):
        if _FAULTS["rng"].random() < _FAULTS["read"]:
            raise OSError("injected read fault")
        return real_read(p)

    disk._write_file, disk._read_file = flaky_write, flaky_read
    tiers, truth = engine.kv.tiers, {}  # chain hash -> the K/V the pool held when it first evicted the block
    real_spill, real_read_tiers = tiers.spill, tiers.read

    def checked_spill(nodes, payload):
        for node, data in zip(nodes, payload):  # determinism: the same tokens always had the same K/V
            assert torch.equal(truth.setdefault(node.hash, data.clone()), data)
        real_spill(nodes, payload)

    def checked_read(found):
        data = real_read_tiers(found)
        for hit, kv in zip(found, data):  # nothing wrong is ever loaded
            assert torch.equal(kv, truth[hit.block.hash])
        return data

    tiers.spill, tiers.read = checked_spill, checked_read
    yield engine, path
    engine.shutdown()


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rounds=st.lists(st.lists(_turn, min_size=1, max_size=3), min_size=2, max_size=4),
    faults=st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)),  # write, read, damage (in 10)
    seed=st.integers(0, 1000),
)
def test_property_tiers_under_eviction_and_faults_stay_exact(reference_engine, tiered, rounds, faults, seed) -> None:
    """Sessions over a 14-block pool with tiny tiers (turns evict), random write and read faults and damaged files:
    every stream equals the run without any cache, every invariant holds after every step, nothing leaks."""
    engine, path = tiered
    rng = random.Random(seed)
    _FAULTS.update(rng=random.Random(seed + 1), write=faults[0] / 10, read=faults[1] / 10)
    conversations = [[rng.randrange(3, 400) for _ in range(rng.randint(5, 20))] for _ in range(3)]
    for turns in rounds:
        prompts, keys, sessions = [], [], []
        for session, new, retained in turns:
            if session in sessions:
                continue
            if len(conversations[session]) + new > 44:  # the pool holds 56 tokens: the session starts over
                conversations[session] = [rng.randrange(3, 400) for _ in range(rng.randint(5, 20))]
            conversations[session] += [rng.randrange(3, 400) for _ in range(new)]
            prompts.append(list(conversations[session]))
            keys.append(f"s{session}" if retained else None)
            sessions.append(session)
        outs, cached = _turns(engine, prompts, keys)
        assert outs == _reference(reference_engine, prompts)
        for p, hit in zip(prompts, cached):
            assert hit % BS == 0 and hit <= len(p) - 1
        for session, out in zip(sessions, outs):
            conversations[session] += out
        engine.kv.tiers.flush()
        for f in sorted((path / "blocks").glob("*.kvb")):  # damage some files: a later load must miss
            if rng.random() < faults[2] / 10:
                data = bytearray(f.read_bytes())
                if rng.random() < 0.5:
                    f.write_bytes(data[: rng.randrange(len(data))])
                else:
                    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
                    f.write_bytes(bytes(data))
    assert_released(engine)
    engine.check_integrity()


def test_the_property_examples_evicted_loaded_and_failed(tiered) -> None:
    """The examples above did evict into both tiers, load back from both, and meet failed reads and writes."""
    engine, _ = tiered
    tiers = engine.snapshot()["kv_tiers"]
    assert engine.kv.evictions > 0
    assert tiers["host"]["loads"] > 0 and tiers["disk"]["loads"] > 0, tiers
    assert tiers["disk"]["failures"] > 0 and tiers["host"]["drops"] > 0, tiers


def test_a_changed_file_never_loads_wrong_kv(tiny_model_dir, reference_engine, tmp_path) -> None:
    """A block file replaced by another block's file (same size, valid checksum) is a miss: the header names its
    block, and the load compares it with what the lookup expects."""
    path = tmp_path / "kv"
    rng = random.Random(3)
    prompt = [rng.randrange(3, 400) for _ in range(21)]
    engine = _engine(tiny_model_dir, kv_disk_path=str(path))
    _turns(engine, [prompt], ["agent"])
    engine.kv.prefix_cache.ensure_free(engine.pool.num_blocks)
    engine.kv.tiers.flush()
    files = sorted((path / "blocks").glob("*.kvb"))
    assert len(files) == (len(prompt) + GREEDY.max_tokens - 1) // BS
    os.replace(files[0], files[1])  # the second name now holds the first's block
    (out,), (cached,) = _turns(engine, [prompt], ["agent"])
    assert out == _reference(reference_engine, [prompt])[0]
    assert cached < (len(prompt) - 1) // BS * BS  # the chain stopped at the block that did not verify
    engine.shutdown()


def test_tier_flags_are_checked(tiny_model_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="needs --kv-disk-path"):
        cpu_config(Path(tiny_model_dir), kv_disk_bytes=1 << 20)
    with pytest.raises(ValueError, match="--no-prefix-cache"):
        cpu_config(Path(tiny_model_dir), kv_disk_path=str(tmp_path), prefix_cache=False)


def test_a_session_comes_back_a_chunk_a_step_while_another_decodes(tiny_model_dir, reference_engine, tmp_path) -> None:
    """Loads are scheduled like prefill chunks: with one block a step allowed, the session's blocks come back over
    several steps, it computes nothing until they are in, and a sequence decoding meanwhile gains a token every
    step; the answer is still exactly the uncached one, and admission's estimates learn the load cost."""
    engine = _engine(tiny_model_dir, num_blocks=20, kv_disk_path=str(tmp_path / "kv"))
    rng = random.Random(11)
    first = [rng.randrange(3, 400) for _ in range(25)]
    (out,), _ = _turns(engine, [first], ["agent"])
    for _ in range(2):  # each needs 19 of the 20 blocks: the agent's blocks go to disk
        _turns(engine, [[rng.randrange(3, 400) for _ in range(70)]], [None])
    engine.kv.tiers.flush()
    assert engine.snapshot()["blocks_disk"] > 0 and engine.snapshot()["load_token_seconds"] is None
    engine.step_budget.load_limit = lambda num_decode, block_seconds: 1 if num_decode else 10**9  # type: ignore[method-assign]

    decoder = engine.submit([rng.randrange(3, 400) for _ in range(6)], SamplingParams(max_tokens=14, temperature=0.0))
    while not any(s.num_output for s in engine._running):
        engine.step()
    second = first + out + [rng.randrange(3, 400) for _ in range(5)]
    agent = engine.submit(second, GREEDY, prompt_cache_key="agent")
    loading_steps, events = 0, {decoder.request_id: [], agent.request_id: []}
    for _ in range(200):
        running = {s.request_id: s for s in engine._running}
        before = running[decoder.request_id].num_output if decoder.request_id in running else None
        engine.step()
        engine.check_integrity()
        seq = next((s for s in engine._running if s.request_id == agent.request_id), None)
        if seq is not None and seq.loading:
            loading_steps += 1
            assert seq.num_computed % BS == 0 and seq.num_computed < len(second)  # loaded blocks only
            if before is not None and decoder.request_id in {s.request_id for s in engine._running}:
                assert running[decoder.request_id].num_output == before + 1  # the decode was not held up
        for h in (decoder, agent):
            while (e := h.stream.get(timeout=0)) is not None:
                events[h.request_id].append(e)
        if all(ev and ev[-1].finished for ev in events.values()):
            break
    computed = len(first) + len(out) - 1
    assert loading_steps >= 3  # one block a step: the blocks came back over several steps
    assert tokens(events[agent.request_id]) == _reference(reference_engine, [second])[0]
    assert max(e.num_cached_tokens for e in events[agent.request_id]) == computed // BS * BS
    load = engine.snapshot()["load_token_seconds"]
    assert load is not None and load == pytest.approx(engine.kv.tiers.load_seconds_per_block / BS)
    assert_released(engine)
    engine.shutdown()
