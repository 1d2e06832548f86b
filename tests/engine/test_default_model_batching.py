"""On the real default model (its quantized GGUF on the fused CPU step, as users run it): a request's
tokens and logprobs are the same bits alone or batched, with or without chunked prefill, after a
prefix-cache hit, across an adaptive-policy preemption and across device-fault replays."""

from __future__ import annotations

import pytest

from helexa.engine.engine import Engine
from helexa.model.sampling import SamplingParams
from tests.support.engines import assert_released, cpu_config, drive, run_streams

pytestmark = pytest.mark.default_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Explain in one sentence why the sky is blue, and mention the word Rayleigh.",
    "Say hello.",
]
PARAMS = [
    SamplingParams(max_tokens=16, temperature=0.0, logprobs=3, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=11, logprobs=3, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.0, logprobs=3, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=1.0, seed=5, logprobs=3, ignore_eos=True),
]


def _engine(model_dir, quantization: str = "auto", **overrides) -> Engine:
    args = dict(num_blocks=96, block_size=16, max_num_batched_tokens=512, quantization=quantization)
    return Engine(cpu_config(model_dir, **{**args, **overrides}))


def _prompts(engine: Engine) -> list[list[int]]:
    return [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in QUESTIONS
    ]


def _streams(events: list) -> tuple[list[int], list[tuple]]:
    """(token ids, per token (id, logprob, top alternatives)) of one request's events."""
    ids = [t for e in events for t in e.token_ids]
    return ids, [(lp.token_id, lp.logprob, lp.top) for e in events for lp in e.logprobs]


def _run(engine: Engine, prompts, params, runner=drive) -> list[tuple[list[int], list[tuple]]]:
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
    events = runner(engine, handles)
    assert_released(engine)
    return [_streams(events[h.request_id]) for h in handles]


@pytest.fixture(scope="module")
def solo(default_model_dir):
    """Each request alone on a fresh engine, its prompt in one prefill: the reference."""
    engine = _engine(default_model_dir)
    assert engine.runner.model.native_step is not None, "the default model should run on the fused CPU step"
    prompts = _prompts(engine)
    return prompts, [_run(_engine(default_model_dir), [p], [sp])[0] for p, sp in zip(prompts, PARAMS)]


def test_batched_and_chunked_is_bit_for_bit_the_solo_run(default_model_dir, solo) -> None:
    """All four at once, 24 tokens a step: every prompt's prefill split across steps while the others
    decode. Greedy and seeded tokens and every logprob are the solo run's exactly."""
    prompts, want = solo
    assert _run(_engine(default_model_dir, max_num_batched_tokens=24), prompts, PARAMS) == want


def test_a_prefix_cache_hit_gives_the_same_bits(default_model_dir, solo) -> None:
    """The same prompts again on a warm engine: their leading blocks come from the cache (computed by
    the first run, in another batch) and only the rest is computed; the answers are the solo runs'."""
    prompts, want = solo
    engine = _engine(default_model_dir, max_num_batched_tokens=24)
    assert _run(engine, prompts, PARAMS) == want
    hits = engine.counters.prefix_cache_hit_tokens
    assert _run(engine, prompts, PARAMS) == want
    assert engine.counters.prefix_cache_hit_tokens > hits


def test_device_fault_replays_continue_exactly(default_model_dir, solo, monkeypatch) -> None:
    """Faults mid-prefill and mid-decode: the replayed streams are the clean ones, token and logprob."""
    prompts, want = solo
    monkeypatch.setenv("HELEXA_FAULT_INJECT", "2,7")
    engine = _engine(default_model_dir, max_num_batched_tokens=24, fault_backoff_secs=0.0)
    assert _run(engine, prompts, PARAMS) == want
    assert engine.counters.device_faults == 2 and engine.counters.model_reloads == 2


def test_an_adaptive_preemption_resumes_exactly(default_model_dir) -> None:
    """Answers taught to be short, requests that write long ones, a pool too small for all four at
    their grown length: the newest are preempted, resumed by recomputation in other batches, and
    still produce the streams each request gives alone, token and logprob."""
    engine = _engine(default_model_dir, policy="adaptive", block_size=4, num_blocks=24, max_wait_secs=3600.0)
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": f"Write a long story about {topic}."}],
                                             add_generation_prompt=True)
        for topic in ("a lighthouse", "two rivers", "a lost key", "the moon")
    ]  # fmt: skip
    params = [SamplingParams(**{**vars(p), "max_tokens": 32, "ignore_eos": False}) for p in PARAMS]
    want = [_run(_engine(default_model_dir, block_size=4), [p], [sp])[0] for p, sp in zip(prompts, params)]
    for _ in range(400):  # answers here are taught to end after 2 tokens: small allowances, so growth preempts
        engine.admission.lengths.observe(2, "stop")
    assert _run(engine, prompts, params, runner=run_streams) == want
    assert engine.counters.preemptions > 0 and engine.counters.recomputed_tokens > 0


def test_the_float_reference_is_batch_invariant_too(default_model_dir) -> None:
    """`--quantization none` (the torch layers) gives the same greedy tokens alone and batched."""
    engine = _engine(default_model_dir, quantization="none")
    assert engine.runner.model.native_step is None
    prompts = _prompts(engine)
    greedy = [SamplingParams(max_tokens=16, temperature=0.0)] * len(prompts)
    solo = [_run(_engine(default_model_dir, quantization="none"), [p], greedy[:1])[0][0] for p in prompts]
    batched = [
        ids
        for ids, _ in _run(_engine(default_model_dir, quantization="none", max_num_batched_tokens=24), prompts, greedy)
    ]
    assert batched == solo
