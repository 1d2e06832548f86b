"""The prefix cache in the real engine: exact output, block-exact accounting under sharing and eviction.

Every stream is compared with the same request run with the cache off (greedy and seeded output must
not depend on what the cache held); every step checks the engine's, the cache's and admission's
invariants (`check_integrity`: every in-use block charged to exactly one reservation or orphaned);
nothing leaks.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helexa.admission import TicketState
from helexa.engine.engine import Engine
from helexa.model.sampling import SamplingParams
from tests.support.engines import assert_released, cpu_config, drive, run_streams, tokens

BS = 4
GREEDY = dict(temperature=0.0)


def _engine(model_dir, num_blocks: int = 256, **overrides) -> Engine:
    args = dict(num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=64, max_wait_secs=60.0, max_num_seqs=6)
    return Engine(cpu_config(model_dir, **{**args, **overrides}))


def _check_hits(engine: Engine) -> None:
    """Every block a running sequence holds through the cache holds exactly that sequence's tokens there."""
    cache = engine.kv.prefix_cache
    for seq in engine._running:
        for i, block in enumerate(engine.kv.holding(seq.request_id).block_ids):
            node = cache.node_of(block)
            if node is not None:  # held through the index: it holds exactly this sequence's tokens there
                assert list(node.tokens) == seq.token_ids[i * BS : (i + 1) * BS]


def _run(engine: Engine, requests, aborts: dict[int, int] | None = None, max_steps: int = 3000):
    """Submit (prompt, params, salt, key) requests; step until all end, aborting request i at step aborts[i]."""
    handles = [engine.submit(p, sp, cache_salt=salt, prompt_cache_key=key) for p, sp, salt, key in requests]
    check = _check_hits if engine.kv.prefix_cache is not None else None
    events = run_streams(engine, handles, aborts, max_steps, check)
    cached = [max((e.num_cached_tokens for e in events[h.request_id]), default=0) for h in handles]
    return [tokens(events[h.request_id]) for h in handles], cached


_REFERENCE: dict = {}


def _reference(model_dir, requests) -> list[list[int]]:
    """Each request's stream with the prefix cache off (memoised: the engine is batch-invariant)."""
    out = []
    missing = [(p, sp) for p, sp, *_ in requests if (tuple(p), repr(sp)) not in _REFERENCE]
    if missing:
        engine = _engine(model_dir, prefix_cache=False)
        got, _ = _run(engine, [(p, sp, None, None) for p, sp in missing])
        for (p, sp), toks in zip(missing, got):
            _REFERENCE[(tuple(p), repr(sp))] = toks
    for p, sp, *_ in requests:
        out.append(_REFERENCE[(tuple(p), repr(sp))])
    return out


_request = st.tuples(
    st.integers(0, 2),  # which shared prefix
    st.integers(0, 9),  # tokens of its own after the prefix
    st.integers(1, 8),  # max_tokens
    st.booleans(),  # greedy or seeded
    st.sampled_from([None, None, "tenant-a"]),  # cache salt
    st.one_of(st.none(), st.none(), st.integers(0, 12)),  # abort at this step
    st.sampled_from([None, "agent-1"]),  # prompt_cache_key
)


@pytest.fixture(scope="module")
def shared_engine(tiny_model_dir):
    """One engine for every example, so its cache arrives warm and full from earlier ones (20 blocks)."""
    return _engine(tiny_model_dir, num_blocks=20, max_num_seqs=4, prefix_retention_secs=5.0)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.lists(_request, min_size=1, max_size=6), seed=st.integers(0, 1000))
def test_property_shared_prefixes_stay_exact_and_nothing_leaks(tiny_model_dir, shared_engine, spec, seed):
    rng = random.Random(1234)  # the same three prefixes in every example: hits across examples too
    prefixes = [[rng.randrange(3, 400) for _ in range(n)] for n in (12, 9, 16)]
    rng = random.Random(seed)
    requests, aborts = [], {}
    for i, (which, extra, max_tokens, greedy, salt, abort_at, key) in enumerate(spec):
        prompt = prefixes[which] + [rng.randrange(3, 400) for _ in range(extra)]
        params = SamplingParams(max_tokens=max_tokens, **GREEDY) if greedy else SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=rng.randrange(1 << 30))  # fmt: skip
        requests.append((prompt, params, salt, key))
        if abort_at is not None:
            aborts[i] = abort_at
    reference = _reference(tiny_model_dir, requests)
    got, cached = _run(shared_engine, requests, aborts)
    for i, (out, ref) in enumerate(zip(got, reference)):
        assert out == (ref[: len(out)] if i in aborts else ref)
    for (prompt, *_), hit in zip(requests, cached):
        assert hit % BS == 0 and hit <= len(prompt) - 1
    assert_released(shared_engine)


def test_the_property_examples_shared_and_evicted(shared_engine) -> None:
    """The examples above ran on one small pool: they did share blocks, and did force eviction."""
    counters = shared_engine.counters
    assert counters.prefix_cache_hit_tokens > 0 and counters.prefix_cache_evictions > 0, counters


def test_a_turn_that_resends_its_conversation_computes_only_the_new_tokens(tiny_model_dir) -> None:
    engine = _engine(tiny_model_dir)
    rng = random.Random(3)
    conversation = [rng.randrange(3, 400) for _ in range(21)]
    seen = []
    for _ in range(4):
        (out,), (hit,) = _run(engine, [(conversation, SamplingParams(max_tokens=5, **GREEDY), None, "s")])
        seen.append(hit)
        assert out == _reference(tiny_model_dir, [(conversation, SamplingParams(max_tokens=5, **GREEDY))])[0]
        conversation = conversation + out + [rng.randrange(3, 400) for _ in range(6)]
    # turn k finds every full block of turn k-1's prompt and answer
    assert seen[0] == 0 and all(b > a for a, b in zip(seen, seen[1:])), seen
    assert engine.counters.prefix_cache_hit_tokens == sum(seen)
    assert_released(engine)


def test_three_concurrent_turns_sharing_a_prefix_fit_where_two_would_without_sharing(tiny_model_dir) -> None:
    """The seed case in miniature: each turn needs 12 blocks alone; the pool has 30."""
    rng = random.Random(11)
    prefix = [rng.randrange(3, 400) for _ in range(40)]  # 10 full blocks
    turns = [prefix + [rng.randrange(3, 400) for _ in range(4)] for _ in range(4)]
    params = SamplingParams(max_tokens=4, ignore_eos=True, **GREEDY)  # 48 tokens = 12 blocks each

    without = _engine(tiny_model_dir, num_blocks=30, prefix_cache=False)
    drive(without, [without.submit(turns[0], params)])
    handles = [without.submit(t, params) for t in turns[1:]]
    assert [h.ticket.state for h in handles] == [TicketState.GRANTED, TicketState.GRANTED, TicketState.QUEUED]
    drive(without, handles)

    engine = _engine(tiny_model_dir, num_blocks=30)
    drive(engine, [engine.submit(turns[0], params)])  # the previous turn leaves the prefix cached
    handles = [engine.submit(t, params) for t in turns[1:]]
    assert [h.ticket.state for h in handles] == [TicketState.GRANTED] * 3
    # the first takes the cached prefix; the others share it
    assert [engine.kv.shared_blocks(h.request_id) for h in handles] == [0, 10, 10]
    assert [h.ticket.blocks_reserved for h in handles] == [12, 2, 2]
    snap = engine.snapshot()
    assert snap["blocks_reserved"] == 16 and snap["blocks_available"] == 14
    events = drive(engine, handles)
    reference = _reference(tiny_model_dir, [(t, params) for t in turns[1:]])
    assert [tokens(events[h.request_id]) for h in handles] == reference
    assert_released(engine)


def test_an_aborted_sharer_leaves_its_blocks_to_the_others(tiny_model_dir) -> None:
    rng = random.Random(5)
    prefix = [rng.randrange(3, 400) for _ in range(24)]
    engine = _engine(tiny_model_dir, num_blocks=40)
    params = SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)
    _run(engine, [(prefix + [7], SamplingParams(max_tokens=1, **GREEDY), None, None)])
    requests = [(prefix + [rng.randrange(3, 400) for _ in range(3)], params, None, None) for _ in range(3)]
    # the first (charged for the prefix) is aborted mid-stream: its prefix blocks become orphans
    got, _ = _run(engine, requests, aborts={0: 3})
    ref = _reference(tiny_model_dir, requests)
    assert got[0] == ref[0][: len(got[0])] and len(got[0]) < 12 and got[1:] == ref[1:]
    assert engine.kv.prefix_cache.orphan_blocks == 0
    assert_released(engine)


def test_salts_isolate_and_keys_are_retained_past_lru(tiny_model_dir) -> None:
    rng = random.Random(9)
    engine = _engine(tiny_model_dir, num_blocks=24, max_num_seqs=2)
    params = SamplingParams(max_tokens=1, ignore_eos=True, **GREEDY)
    agent = [rng.randrange(3, 400) for _ in range(17)]
    _run(engine, [(agent, params, "t1", "agent")])
    (_, (hit,)) = _run(engine, [(agent + [5], params, "t2", None)])
    assert hit == 0  # another tenant's salt shares nothing
    # a flood of unrelated requests evicts cached blocks; the agent's retained ones go last
    for _ in range(6):
        _run(engine, [([rng.randrange(3, 400) for _ in range(25)], params, None, None)])
    assert engine.counters.prefix_cache_evictions > 0
    (_, (hit,)) = _run(engine, [(agent + [5], params, "t1", "agent")])
    assert hit == 16
    assert_released(engine)


def test_replay_after_a_fault_with_a_warm_cache_is_exact(tiny_model_dir, monkeypatch) -> None:
    rng = random.Random(2)
    prefix = [rng.randrange(3, 400) for _ in range(20)]
    requests = [(prefix + [rng.randrange(3, 400) for _ in range(2)], SamplingParams(max_tokens=8, **GREEDY), None, None)
                for _ in range(3)]  # fmt: skip
    reference = _reference(tiny_model_dir, requests)
    monkeypatch.setenv("HELEXA_FAULT_INJECT", "3")
    engine = _engine(tiny_model_dir, num_blocks=24, fault_backoff_secs=0.0)
    _run(engine, [(prefix + [9], SamplingParams(max_tokens=1, **GREEDY), None, None)])  # warm: steps 1-2
    got, cached = _run(engine, requests)  # step 3 faults: the replays start from an empty cache
    assert got == reference and engine.counters.model_reloads == 1
    assert cached[1] > 0  # they shared before the fault (and reported it)
    assert_released(engine)


def test_n_choices_compute_their_shared_prompt_once(tiny_model_dir) -> None:
    """Concurrent requests with one prompt (a request's `n` choices): the later ones wait for the first to
    prefill it, then share its blocks — measured again, so they reserve only what they add."""
    rng = random.Random(8)
    prompt = [rng.randrange(3, 400) for _ in range(30)]  # 7 full blocks and 2 tokens
    engine = _engine(tiny_model_dir, num_blocks=64)
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    handles = [engine.submit(prompt, p) for p in params]
    engine.step()
    assert len(engine._deferred) == 3  # held back behind the first choice's prefill
    shares: dict[str, int] = {}

    def record_shares(eng) -> None:  # what each holds through others, while it runs
        for seq in eng._running:
            shares.setdefault(seq.request_id, eng.kv.shared_blocks(seq.request_id))

    events = run_streams(engine, handles, after_step=record_shares)
    cached = [max(e.num_cached_tokens for e in events[h.request_id]) for h in handles]
    assert cached == [0, 28, 28, 28]
    assert [shares[h.request_id] for h in handles] == [0, 7, 7, 7]
    assert [h.ticket.blocks_reserved for h in handles] == [9, 2, 2, 2]  # ceil(36 / 4) = 9 alone
    assert engine.counters.prompt_tokens == 30 + 3 * 2  # the prompt once, then each choice's last 2 tokens
    reference = _reference(tiny_model_dir, [(prompt, p) for p in params])
    assert [tokens(events[h.request_id]) for h in handles] == reference
    assert_released(engine)


def test_a_held_back_request_can_be_aborted(tiny_model_dir) -> None:
    rng = random.Random(4)
    prompt = [rng.randrange(3, 400) for _ in range(60)]
    engine = _engine(tiny_model_dir, num_blocks=64, max_num_batched_tokens=8)  # a prefill of 8 steps
    params = SamplingParams(max_tokens=3, **GREEDY)
    first, second = engine.submit(prompt, params), engine.submit(prompt, params)
    engine.step()
    assert second.ticket.id in engine._deferred
    engine.abort(second.request_id)
    events = drive(engine, [first, second])
    assert events[second.request_id][-1].finish_reason == "abort" and not engine._deferred
    assert_released(engine)


def test_threads_sharing_prefixes_through_a_running_engine_leak_nothing(tiny_model_dir) -> None:
    """Grants (and their pins) happen on the submitting threads while the engine thread inserts and evicts:
    4 threads x 8 requests over 3 prefixes on a 40-block pool, some aborted mid-way. Every stream ends
    once, greedy ones equal their uncached runs, and afterwards every invariant holds with nothing in use."""
    import threading
    import time

    rng = random.Random(21)
    prefixes = [[rng.randrange(3, 400) for _ in range(n)] for n in (13, 22, 17)]
    plans = [
        [(prefixes[rng.randrange(3)] + [rng.randrange(3, 400) for _ in range(rng.randrange(6))],
          SamplingParams(max_tokens=rng.randint(1, 6), **GREEDY), rng.random() < 0.25) for _ in range(8)]
        for _ in range(4)
    ]  # fmt: skip
    engine = _engine(tiny_model_dir, num_blocks=40, max_num_seqs=4)
    engine.start()
    results: list[tuple[list[int], list[int], bool, str]] = []
    errors: list[BaseException] = []

    def client(plan) -> None:
        try:
            for prompt, params, abort in plan:
                handle = engine.submit(prompt, params, prompt_cache_key="shared-agent")
                if abort:
                    time.sleep(0.002)
                    engine.abort(handle.request_id)
                events = list(handle.stream)
                results.append((prompt, tokens(events), abort, events[-1].finish_reason))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(plan,)) for plan in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    engine.shutdown()
    assert not errors and len(results) == 32 and not any(t.is_alive() for t in threads)
    engine.check_integrity()
    assert_released(engine)
    for prompt, out, aborted, reason in results:
        ref = _reference(tiny_model_dir, [(prompt, SamplingParams(max_tokens=6, **GREEDY))])[0]
        assert out == ref[: len(out)]
        assert aborted or reason in ("stop", "length")
