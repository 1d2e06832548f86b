"""16-bit KV on the CPU: a quantized model served through the fused C step may keep its KV pool in
float16 (`--kv-cache-dtype float16`: llama.cpp's footprint, twice the blocks of float32 in the same
memory), and that is what `auto` gives there. The choice, the flag's explicit values and their refusals,
and repeatable greedy output. Accuracy at scale (teacher-forced
top-1 agreement over 2k tokens) is measured in bench/, not here."""

from __future__ import annotations

import pytest
import torch

from helexa.engine.loading import kv_cache_dtype
from helexa.model.quant import native
from helexa.model.sampling import SamplingParams
from tests.support.engines import drive, make_engine, random_prompts, tokens

MEMORY = 1 << 20  # 1 MiB of KV

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.unavailable_reason()}")


def test_auto_is_float16_under_the_fused_step_and_the_model_dtype_elsewhere() -> None:
    assert kv_cache_dtype("auto", torch.float32, fused_cpu_step=True) is torch.float16
    assert kv_cache_dtype("float16", torch.float32, fused_cpu_step=True) is torch.float16
    assert kv_cache_dtype("auto", torch.float32) is torch.float32  # a dense float32 model keeps float32
    assert kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_dtype("float32", torch.float32, fused_cpu_step=True) is torch.float32
    assert kv_cache_dtype("float16", torch.float16) is torch.float16
    with pytest.raises(ValueError, match="float16 needs a float16 model or .* the fused CPU step"):
        kv_cache_dtype("float16", torch.float32)
    with pytest.raises(ValueError, match="float32 needs a float32 model"):
        kv_cache_dtype("float32", torch.bfloat16)


def _greedy(engine, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    handles = [engine.submit(p, params) for p in prompts]
    events = drive(engine, handles)
    return [tokens(events[h.request_id]) for h in handles]


def test_a_quantized_cpu_model_serves_from_a_float16_pool(tiny_model_dir) -> None:
    """Same memory, twice the blocks of float32; every request completes, and repeated runs give the same
    tokens."""
    half = make_engine(
        tiny_model_dir, quantization="int4", kv_cache_dtype="float16", num_blocks=None, kv_cache_memory=MEMORY
    )
    full = make_engine(
        tiny_model_dir, quantization="int4", kv_cache_dtype="float32", num_blocks=None, kv_cache_memory=MEMORY
    )
    assert half.pool.dtype == torch.float16 and full.pool.dtype == torch.float32
    assert half.budget.num_blocks == 2 * full.budget.num_blocks
    prompts = random_prompts(6, seed=3)
    got = _greedy(half, prompts)
    assert all(len(ids) == 12 for ids in got + _greedy(full, prompts))
    assert _greedy(half, prompts) == got
    half.pool.check_integrity()


def test_auto_follows_the_step_that_runs_the_model(tiny_model_dir, monkeypatch) -> None:
    """A quantized model on the fused step gets a float16 pool from `auto`; the same model through the torch
    layers (`HELEXA_CPU_STEP=torch`), and a dense model, keep float32 at twice the bytes a block."""
    fused = make_engine(tiny_model_dir, quantization="int4", num_blocks=None, kv_cache_memory=MEMORY)
    dense = make_engine(tiny_model_dir, quantization="none", num_blocks=None, kv_cache_memory=MEMORY)
    monkeypatch.setenv("HELEXA_CPU_STEP", "torch")
    layers = make_engine(tiny_model_dir, quantization="int4", num_blocks=None, kv_cache_memory=MEMORY)
    assert fused.runner.model.native_step is not None and layers.runner.model.native_step is None
    assert fused.pool.dtype == torch.float16
    assert layers.pool.dtype == dense.pool.dtype == torch.float32
    assert fused.budget.bytes_per_block * 2 == layers.budget.bytes_per_block == dense.budget.bytes_per_block
