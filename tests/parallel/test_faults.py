"""A fault on any rank is a device fault of the whole group: torn down, rebuilt with the same block count,
in-flight streams replayed to exactly what an unfaulted run gives, and no process left behind."""

from __future__ import annotations

import os
import signal

import pytest

from helexa.model.sampling import SamplingParams
from tests.parallel.conftest import pid_alive, tp_engine
from tests.support.engines import assert_released, random_prompts, run_streams, tokens

pytestmark = pytest.mark.alone  # measures time: a rank that does not answer within --step-timeout-secs 2 is a fault

PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0.9, top_k=50, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True),
]


def _streams(engine, after_step=None) -> list[list[int]]:
    handles = [engine.submit(p, sp) for p, sp in zip(random_prompts(3, seed=4), PARAMS)]
    events = run_streams(engine, handles, after_step=after_step)
    return [tokens(events[h.request_id]) for h in handles]


def test_worker_exception_and_sigkill_are_survived(tiny_models, fault_env) -> None:
    clean_engine = tp_engine(tiny_models["llama"], 1, max_num_batched_tokens=16)
    clean = _streams(clean_engine)
    clean_engine.shutdown()

    fault_env(HELEXA_FAULT_INJECT="3", HELEXA_FAULT_INJECT_RANK="1")  # rank 1 raises mid-prefill
    engine = tp_engine(tiny_models["llama"], 2, max_num_batched_tokens=16)
    seen_pids: set[int] = set(engine.runner.group.worker_pids)
    killed: list[int] = []

    def kill_once_decoding(eng) -> None:  # after the reload, SIGKILL the new worker mid-decode
        seen_pids.update(eng.runner.group.worker_pids)
        if not killed and eng.counters.model_reloads == 1 and eng.counters.generation_tokens >= 6:
            killed.append(eng.runner.group.worker_pids[0])
            os.kill(killed[0], signal.SIGKILL)

    try:
        got = _streams(engine, after_step=kill_once_decoding)
        assert engine.counters.device_faults == 2 and engine.counters.model_reloads == 2
        assert engine.pool.num_blocks == engine.first_num_blocks == 64  # the agreed count, again
        assert engine.runner.group.agreed == 64 and engine.health.state == "loaded"
        assert_released(engine)
    finally:
        engine.shutdown()
    assert got == clean  # greedy and seeded streams both continue exactly
    assert len(seen_pids) == 3 and killed and not any(pid_alive(p) for p in seen_pids)


def test_a_hung_worker_is_a_fault_after_the_step_timeout(tiny_models, fault_env, caplog) -> None:
    clean_engine = tp_engine(tiny_models["qwen2"], 1, max_num_batched_tokens=16)
    clean = _streams(clean_engine)
    clean_engine.shutdown()

    fault_env(HELEXA_FAULT_INJECT="4", HELEXA_FAULT_INJECT_RANK="1", HELEXA_FAULT_INJECT_MODE="hang")
    engine = tp_engine(tiny_models["qwen2"], 2, max_num_batched_tokens=16, step_timeout_secs=2.0)
    hung = engine.runner.group.worker_pids[0]
    try:
        with caplog.at_level("ERROR", logger="helexa.engine"):
            got = _streams(engine)
        assert engine.counters.device_faults == 1 and engine.pool.num_blocks == engine.first_num_blocks
        assert not pid_alive(hung)  # stopped through its lifeline although its main thread sleeps
    finally:
        engine.shutdown()
    assert got == clean
    assert any("did not answer within --step-timeout-secs 2" in r.getMessage() for r in caplog.records)
