"""Device faults (HELEXA_FAULT_INJECT): reload with the same budget, replay, identical output; bounded retries."""

from __future__ import annotations

import pytest

from helexa.engine.faults import FaultInjector
from helexa.engine.interface import DeviceFault
from helexa.model.sampling import SamplingParams
from tests.support.engines import assert_released, drive, make_engine, random_prompts, tokens

PARAMS = [
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0.9, top_k=50, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True),
]


def _run(model_dir, **overrides) -> tuple[list[list[int]], list[str], object]:
    engine = make_engine(model_dir, max_num_batched_tokens=16, fault_backoff_secs=0.0, **overrides)
    handles = [engine.submit(p, sp) for p, sp in zip(random_prompts(3, seed=4), PARAMS)]
    events = drive(engine, handles)
    texts = ["".join(e.text for e in events[h.request_id]) for h in handles]
    return [tokens(events[h.request_id]) for h in handles], texts, engine


def test_injected_faults_are_invisible_except_latency(tiny_model_dir, monkeypatch):
    clean_tokens, clean_texts, _ = _run(tiny_model_dir)
    monkeypatch.setenv("HELEXA_FAULT_INJECT", "2,6")  # mid-prefill (chunked) and mid-decode
    tokens, texts, engine = _run(tiny_model_dir)
    assert tokens == clean_tokens and texts == clean_texts  # greedy and seeded streams both continue exactly
    assert engine.counters.device_faults == 2 and engine.counters.model_reloads == 2
    assert engine.pool.num_blocks == engine.first_num_blocks
    assert engine.health.state == "loaded"
    assert_released(engine)


def test_repeated_faults_leave_the_node_poisoned_with_the_cause(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HELEXA_FAULT_INJECT", "1,2,3,4,5,6")
    engine = make_engine(tiny_model_dir, max_fault_retries=2, fault_backoff_secs=0.0, num_blocks=16)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    running = engine.submit(list(range(3, 43)), params)
    queued = engine.submit(list(range(5, 45)), params)  # needs the blocks the first one holds: waits
    events = drive(engine, [running, queued])
    for h in (running, queued):
        final = events[h.request_id][-1]
        assert final.finish_reason == "error" and isinstance(final.error, DeviceFault)
        assert "injected device fault" in str(final.error)
    assert engine.health.state == "poisoned" and engine.counters.device_faults == 3
    with pytest.raises(DeviceFault, match="injected device fault"):
        engine.submit([3, 4, 5], params)
    snap = engine.snapshot()
    assert snap["blocks_reserved"] == 0 and snap["queue_depth"] == 0 and snap["in_flight"] == 0


def test_budget_change_across_reload_keeps_the_node_poisoned(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HELEXA_FAULT_INJECT", "2")
    engine = make_engine(tiny_model_dir, fault_backoff_secs=0.0)
    original_load = engine._load_runner

    def load_with_other_budget():
        engine.config = engine.config.replace(num_blocks=63)
        return original_load()

    monkeypatch.setattr(engine, "_load_runner", load_with_other_budget)
    h = engine.submit([3, 4, 5, 6], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    events = drive(engine, [h])[h.request_id]
    assert events[-1].finish_reason == "error" and "64 -> 63 blocks" in str(events[-1].error)
    assert engine.health.state == "poisoned"


def test_fault_injection_list_is_validated():
    assert FaultInjector.from_env("3, 7").pending == {3, 7}
    assert FaultInjector.from_env("").pending == set()
    with pytest.raises(ValueError, match="HELEXA_FAULT_INJECT"):
        FaultInjector.from_env("3,x")
    with pytest.raises(ValueError, match="HELEXA_FAULT_INJECT"):
        FaultInjector.from_env("0")


def test_a_request_whose_own_sampling_fails_fails_alone(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir)
    real_sample = engine.runner.sampler.sample

    def picky_sample(logits, params, *args, **kwargs):
        if any(p.seed == 666 for p in params):
            raise ValueError("this request's parameters cannot be sampled")
        return real_sample(logits, params, *args, **kwargs)

    monkeypatch.setattr(engine.runner.sampler, "sample", picky_sample)
    good = engine.submit([3, 4, 5], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    bad = engine.submit([3, 4, 5], SamplingParams(max_tokens=6, temperature=1.0, seed=666, ignore_eos=True))
    events = drive(engine, [good, bad])
    assert events[good.request_id][-1].finish_reason == "length" and len(tokens(events[good.request_id])) == 6
    final = events[bad.request_id][-1]
    assert final.finish_reason == "error" and "cannot be sampled" in str(final.error)
    assert engine.counters.device_faults == 0 and engine.health.state == "loaded"
    assert_released(engine)
