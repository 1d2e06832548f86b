"""`--kv-cache-dtype fp8` end to end on a tiny random model: 4x the blocks of float32 in the same
memory, calibrated scales, finite outputs, greedy agreement with the unquantized cache, and the
prefix cache, preemption and device-fault replay all exact on the fp8 cache."""

from __future__ import annotations

import math

import pytest
import torch

from helexa.config import EngineConfig
from helexa.engine.engine import Engine
from helexa.engine.loading import KV_CALIBRATION_TEXT, kv_cache_dtype, kv_calibration_ids
from helexa.kernels import FP8_KV_DTYPE
from helexa.model.sampling import SamplingParams
from tests.support.engines import assert_released, cpu_config, drive, make_engine, random_prompts, run_streams, tokens

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
MEMORY = 1 << 20  # 1 MiB: 256 float32 blocks of 8 tokens on the tiny model (2 layers, 2 KV heads, D 16)


@pytest.fixture(scope="module")
def fp8_engine(tiny_model_dir) -> Engine:
    return make_engine(tiny_model_dir, kv_cache_dtype="fp8", num_blocks=None, kv_cache_memory=MEMORY)


@pytest.fixture(scope="module")
def auto_engine(tiny_model_dir) -> Engine:
    return make_engine(tiny_model_dir, num_blocks=None, kv_cache_memory=MEMORY)


def _greedy(engine: Engine, prompts, params=GREEDY) -> list[list[int]]:
    handles = [engine.submit(p, params) for p in prompts]
    events = drive(engine, handles)
    return [tokens(events[h.request_id]) for h in handles]


def test_config_flag_and_alias():
    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig.of(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        EngineConfig.of(kv_cache_dtype="int8")
    assert kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_dtype("fp8", torch.float32) is kv_cache_dtype("fp8_e4m3", torch.bfloat16) is FP8_KV_DTYPE


def test_same_memory_holds_exactly_4x_the_float32_blocks(fp8_engine, auto_engine):
    assert auto_engine.pool.dtype == torch.float32 and fp8_engine.pool.dtype == FP8_KV_DTYPE
    assert fp8_engine.budget.num_blocks == 4 * auto_engine.budget.num_blocks == 4 * 256
    assert fp8_engine.budget.bytes_per_block * 4 == auto_engine.budget.bytes_per_block
    assert fp8_engine.admission.snapshot()["blocks_total"] == 1024
    assert fp8_engine.dtype == torch.float32  # the weights and activations keep the model dtype


def test_scales_are_calibrated_per_layer_and_head_on_the_fixed_text(fp8_engine, tiny_model_dir):
    scales = fp8_engine.pool.kv_scales
    assert scales is not None and scales.shape == (2, 2, 2)  # (layers, K|V, KV heads)
    assert torch.isfinite(scales).all() and (scales > 0).all() and not (scales == 1.0).all()
    assert len(set(scales.flatten().tolist())) > 1  # each layer and head its own
    ids = kv_calibration_ids(fp8_engine.tokenizer)
    assert len(ids) > 64 and fp8_engine.tokenizer.decode(ids).count("lighthouse") == 1
    assert "lighthouse" in KV_CALIBRATION_TEXT
    again = make_engine(tiny_model_dir, kv_cache_dtype="fp8_e4m3", num_blocks=32)  # deterministic
    assert torch.equal(again.pool.kv_scales, scales)


def test_outputs_are_finite_and_greedy_mostly_agrees_with_the_unquantized_cache(fp8_engine, auto_engine):
    prompts = random_prompts(6, seed=1)
    fp8, auto = _greedy(fp8_engine, prompts), _greedy(auto_engine, prompts)
    # the share of each answer before it first differs from the unquantized one
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) / len(x) for x, y in zip(fp8, auto)]
    assert sum(agree) / len(agree) >= 0.5, agree
    assert sum(a == 1.0 for a in agree) >= 3, agree
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    handle = fp8_engine.submit(prompts[0], params)
    events = drive(fp8_engine, [handle])[handle.request_id]
    logprobs = [lp for e in events for lp in (e.logprobs or [])]
    assert len(logprobs) == 8
    for entry in logprobs:
        assert all(math.isfinite(v) for v in _numbers(entry))
    for layer in range(2):  # nothing NaN or inf was ever written
        for cache in (fp8_engine.pool.k_cache(layer), fp8_engine.pool.v_cache(layer)):
            assert torch.isfinite(cache.float()).all()
    assert_released(fp8_engine)


def _numbers(entry) -> list[float]:
    """Every float in a logprobs entry, whatever its shape (objects, dicts, tuples)."""
    if isinstance(entry, float):
        return [entry]
    if isinstance(entry, dict):
        return [x for v in entry.values() for x in _numbers(v)]
    if isinstance(entry, (list, tuple)):
        return [x for v in entry for x in _numbers(v)]
    if hasattr(entry, "__dict__"):
        return _numbers(vars(entry))
    return []


def test_prefix_cache_hits_are_exact_on_fp8_blocks(tiny_model_dir):
    engine = make_engine(tiny_model_dir, kv_cache_dtype="fp8")
    prompt = random_prompts(1, seed=9)[0] * 3  # long enough for full blocks
    first = _greedy(engine, [prompt])
    hits_before = engine.counters.prefix_cache_hit_tokens
    second = _greedy(engine, [prompt])
    assert engine.counters.prefix_cache_hit_tokens > hits_before
    assert second == first  # a cached fp8 block holds exactly what recomputing it writes
    assert_released(engine)


def test_preemption_and_resume_are_exact_on_fp8(tiny_model_dir):
    def engine(policy: str, num_blocks: int) -> Engine:
        config = cpu_config(
            tiny_model_dir, kv_cache_dtype="fp8", policy=policy, num_blocks=num_blocks, block_size=4,
            max_num_batched_tokens=64, max_wait_secs=60.0, max_num_seqs=6,
        )  # fmt: skip
        return Engine(config)

    requests = [(p, SamplingParams(max_tokens=30, temperature=0.0)) for p in random_prompts(5, seed=3)]
    reference = engine("reserve", 512)
    want = run_streams(reference, [reference.submit(p, sp) for p, sp in requests])
    adaptive = engine("adaptive", 24)
    for _ in range(30):  # answers are expected to end early: small allowances, so the pool runs short
        adaptive.admission.lengths.observe(4, "stop")
    handles = [adaptive.submit(p, sp) for p, sp in requests]
    got = run_streams(adaptive, handles)
    assert [tokens(e) for e in got.values()] == [tokens(e) for e in want.values()]
    assert adaptive.counters.preemptions > 0
    assert_released(adaptive)


def test_device_fault_replay_is_exact_and_recalibrates_the_same_scales(tiny_model_dir, monkeypatch):
    prompts = random_prompts(3, seed=4)
    clean_engine = make_engine(tiny_model_dir, kv_cache_dtype="fp8", max_num_batched_tokens=16)
    clean = _greedy(clean_engine, prompts)
    monkeypatch.setenv("HELEXA_FAULT_INJECT", "2,6")
    engine = make_engine(tiny_model_dir, kv_cache_dtype="fp8", max_num_batched_tokens=16, fault_backoff_secs=0.0)
    assert _greedy(engine, prompts) == clean
    assert engine.counters.model_reloads == 2 and engine.pool.num_blocks == engine.first_num_blocks
    assert torch.equal(engine.pool.kv_scales, clean_engine.pool.kv_scales)
    assert_released(engine)


def test_triton_backend_in_the_interpreter_agrees_with_torch_on_fp8(tiny_model_dir):
    prompts = random_prompts(2, seed=6)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    torch_out = _greedy(make_engine(tiny_model_dir, kv_cache_dtype="fp8", num_blocks=16), prompts, params)
    triton_engine = make_engine(tiny_model_dir, kv_cache_dtype="fp8", num_blocks=16, attention_backend="triton")
    assert _greedy(triton_engine, prompts, params) == torch_out


def test_server_flag_parses_and_bad_values_exit_2(capsys):
    from helexa.server.cli import build_parser, configs_from_args

    for value in ("fp8", "fp8_e4m3", "auto"):
        config, _ = configs_from_args(build_parser().parse_args(["--kv-cache-dtype", value]))
        assert config.kv_cache_dtype == value
    assert configs_from_args(build_parser().parse_args([]))[0].kv_cache_dtype == "auto"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--kv-cache-dtype", "fp16"])
    assert exc.value.code == 2 and "--kv-cache-dtype" in capsys.readouterr().err


def test_a_real_server_on_fp8_serves_and_reports_its_4x_blocks_in_metrics(tmp_path):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from tests.support.servers import RunningServer, make_tiny_model_dir, tiny_engine_config

    model_dir = make_tiny_model_dir(tmp_path)
    running = RunningServer(
        tiny_engine_config(model_dir, kv_cache_dtype="fp8", num_blocks=None, kv_cache_memory=MEMORY)
    )
    try:
        fp8_blocks = running.engine.budget.num_blocks
        float32 = running.engine.budget.bytes_per_block * 4
        assert fp8_blocks == MEMORY // running.engine.budget.bytes_per_block == 4 * (MEMORY // float32)
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 5, "temperature": 0.0}
        reply = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
        metrics = httpx.get(f"{running.url}/metrics", timeout=10).text
        samples = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
        assert samples["helexa_kv_blocks_total"] == fp8_blocks and samples["helexa_generation_tokens_total"] >= 5
        assert httpx.get(f"{running.url}/v1/admission", timeout=10).json()["blocks_total"] == fp8_blocks
    finally:
        running.stop()
