"""The adaptive policy in the real engine: grow by whole blocks, preempt the newest, resume by recomputation.

The reference for every stream is the same request run without any preemption (policy `reserve`,
a pool that holds everything). Greedy and seeded streams must equal it token for token; aborted
ones must be a prefix of it; every step keeps the engine's and admission's invariants; nothing leaks.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helexa.engine.engine import Engine
from helexa.model.sampling import SamplingParams
from tests.support.engines import assert_released, cpu_config, drive, run_streams, tokens

BLOCK = 4


def _engine(model_dir, policy: str, num_blocks: int, teach: int | None = None) -> Engine:
    engine = Engine(
        cpu_config(
            model_dir,
            policy=policy,
            num_blocks=num_blocks,
            block_size=BLOCK,
            max_num_batched_tokens=64,
            max_wait_secs=60.0,
            max_num_seqs=6,
        )
    )
    if teach is not None:  # answers here are known to end after `teach` tokens: small allowances
        for _ in range(30):
            engine.admission.lengths.observe(teach, "stop")
    return engine


def _run(engine: Engine, requests, aborts: dict[int, int] | None = None, max_steps: int = 3000) -> list[list[int]]:
    """Submit every request, step until all end (aborting request i at step aborts[i]); invariants every step."""
    handles = [engine.submit(prompt, params) for prompt, params in requests]
    events = run_streams(engine, handles, aborts, max_steps)
    return [tokens(events[h.request_id]) for h in handles]


def _params(rng: random.Random, max_tokens: int) -> SamplingParams:
    if rng.random() < 0.5:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=40, seed=rng.randrange(1 << 30))


def test_adaptive_preempts_the_newest_and_every_stream_is_unchanged(tiny_model_dir) -> None:
    rng = random.Random(5)
    requests = [([rng.randrange(3, 400) for _ in range(rng.randint(4, 12))], _params(rng, 40)) for _ in range(6)]
    reference = _run(_engine(tiny_model_dir, "reserve", 256), requests)
    # 24 blocks of 4 tokens: one request's bound is <= 13 blocks, all six at full length would need ~70
    adaptive = _engine(tiny_model_dir, "adaptive", 24, teach=4)
    assert _run(adaptive, requests) == reference
    snap = adaptive.snapshot()
    assert adaptive.counters.preemptions > 0 and snap["preemptions"] == adaptive.counters.preemptions
    assert snap["recomputed_tokens"] == adaptive.counters.recomputed_tokens > 0
    assert snap["preempted_waiting"] == 0
    assert_released(adaptive)


def test_adaptive_learns_from_what_it_serves(tiny_model_dir) -> None:
    engine = _engine(tiny_model_dir, "adaptive", 64)
    requests = [([5, 6, 7, i + 8], SamplingParams(max_tokens=6, temperature=0.0)) for i in range(3)]
    _run(engine, requests)
    assert engine.admission.lengths.samples == 3  # each ended by "stop" or at its limit ("length")
    # requests that can only end at their limit teach nothing and reserve their bound
    bench = engine.submit([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    assert bench.ticket.blocks_reserved == -(-(3 + 20) // BLOCK)
    drive(engine, [bench])
    assert engine.admission.lengths.samples == 3
    assert_released(engine)


_request = st.tuples(
    st.integers(1, 14),  # prompt length
    st.integers(1, 30),  # max_tokens
    st.booleans(),  # greedy or seeded
    st.integers(0, 24),  # stop token ids drawn: answers of varied, unannounced lengths
    st.one_of(st.none(), st.integers(0, 40)),  # abort at this step
)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    spec=st.lists(_request, min_size=2, max_size=6),
    num_blocks=st.integers(12, 30),
    teach=st.integers(1, 6),
    seed=st.integers(0, 1000),
)
def test_adaptive_property_streams_equal_their_unpreempted_runs(tiny_model_dir, spec, num_blocks, teach, seed):
    rng = random.Random(seed)
    requests, aborts = [], {}
    for i, (prompt_len, max_tokens, greedy, n_stop, abort_at) in enumerate(spec):
        prompt = [rng.randrange(3, 400) for _ in range(prompt_len)]
        stop_ids = rng.sample(range(3, 512), n_stop)
        params = (
            SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop_ids)
            if greedy
            else SamplingParams(
                max_tokens=max_tokens, temperature=1.0, seed=rng.randrange(1 << 30), stop_token_ids=stop_ids
            )
        )
        requests.append((prompt, params))
        if abort_at is not None:
            aborts[i] = abort_at
    # the smallest pool must still hold any one request alone: ceil((14 + 30) / 4) = 11 blocks
    reference = _run(_engine(tiny_model_dir, "reserve", 256), requests)
    adaptive = _engine(tiny_model_dir, "adaptive", num_blocks, teach=teach)
    got = _run(adaptive, requests, aborts)
    for i, (out, ref) in enumerate(zip(got, reference)):
        if i in aborts:
            assert out == ref[: len(out)]
        else:
            assert out == ref
    assert_released(adaptive)
