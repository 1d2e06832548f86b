"""Tensor parallelism on gloo gives what one device gives: the same greedy tokens, logits within fp32 rounding."""

from __future__ import annotations

import pytest

from helexa.engine.engine import Engine
from helexa.model.sampling import SamplingParams
from tests.parallel.conftest import pid_alive, tp_engine
from tests.support.engines import drive, tokens

# A long prompt (400 tokens: 50 blocks of 8) widens the block tables past the step buffer's first size
# (sized for 4 sequences of 16 blocks).
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(40, 61)), [3 + (7 * i) % 300 for i in range(400)]]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5)


def _generate(engine: Engine) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    """Greedy tokens and, per token, the top-5 logprobs, for every prompt (batched, chunked prefill)."""
    handles = [engine.submit(p, PARAMS) for p in PROMPTS]
    events = drive(engine, handles)
    out_tokens = [tokens(events[h.request_id]) for h in handles]
    tops = [[dict(lp.top) for e in events[h.request_id] for lp in e.logprobs] for h in handles]
    return out_tokens, tops


@pytest.mark.parametrize(("arch", "size"), [("llama", 2), ("qwen2", 2), ("qwen3", 2), ("qwen3", 4)])
def test_tensor_parallel_matches_one_device(tiny_models, arch: str, size: int) -> None:
    reference = tp_engine(tiny_models[arch], 1, max_num_seqs=4)
    want_tokens, want_tops = _generate(reference)
    reference.shutdown()

    engine = tp_engine(tiny_models[arch], size, max_num_seqs=4)
    group = engine.runner.group
    pids = group.worker_pids
    assert len(pids) == size - 1 and all(pid_alive(p) for p in pids)
    try:
        got_tokens, got_tops = _generate(engine)
        assert group.channel.capacity > group.spec.capacity  # the long prompt's tables grew the buffer once
        assert engine.pool.num_blocks == reference.pool.num_blocks == 64
        # each rank's pool holds its share of the KV heads (one replicated KV head per rank at TP 4)
        assert engine.pool.num_kv_heads == max(1, 2 // size)
    finally:
        engine.shutdown()
    assert not any(pid_alive(p) for p in pids)
    assert got_tokens == want_tokens
    for want_seq, got_seq in zip(want_tops, got_tops):
        for want, got in zip(want_seq, got_seq):
            assert want.keys() == got.keys()
            assert all(abs(want[t] - got[t]) < 1e-4 for t in want), (want, got)
