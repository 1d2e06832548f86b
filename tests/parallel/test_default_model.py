"""The default model (SmolLM2-135M: 9 heads, 3 KV heads) at the sizes its heads allow: TP 3 serves what one
device serves; TP 2 is refused at start-up, before any worker starts, saying which sizes work."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from helexa import LLM, SamplingParams
from tests.parallel.conftest import child_pids

pytestmark = pytest.mark.default_model

QUESTIONS = ["What is the capital of France?", "Name three primary colours."]


def _llm(model_dir, tensor_parallel_size: int) -> LLM:
    """The float reference on both sides: the pulled model stores quantized weights, which tensor
    parallelism dequantises at load (as `quantization="none"` does on one device)."""
    return LLM(str(model_dir), device="cpu", dtype="float32", attention_backend="torch", num_blocks=64,
               max_num_seqs=4, max_num_batched_tokens=128, quantization="none",
               tensor_parallel_size=tensor_parallel_size)  # fmt: skip


def test_default_model_at_tp2_is_refused_with_the_sizes_that_work(default_model_dir) -> None:
    before = child_pids()
    with pytest.raises(
        ValueError, match=r"9 attention heads are not divisible by 2.*Sizes that work for this model: 1, 3$"
    ):
        _llm(default_model_dir, 2)
    assert child_pids() == before and not mp.active_children()


@pytest.mark.slow
def test_default_model_at_tp3_matches_one_device(default_model_dir) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0)
    single = _llm(default_model_dir, 1)
    prompts = [
        single.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in QUESTIONS
    ]
    want = [o.token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    single.close()
    with _llm(default_model_dir, 3) as sharded:
        assert sharded.engine.pool.num_kv_heads == 1  # each of the 3 ranks holds one of the 3 KV heads
        got = [o.token_ids for o in sharded.generate(prompts, params, use_tqdm=False)]
    assert got == want
