"""What a CUDA node runs, on the CPU: the model's linear layers through the Triton dense matmul (as
`helexa.kernels.linear` dispatches on CUDA) and attention through the Triton kernel, both in the
interpreter. Greedy tokens and their logprobs must be bit for bit the same alone, batched, arriving
mid-step and in small prefill chunks. With torch's matmul in the layers they were not on this CPU
(logprobs differed in the last bits; checked by swapping F.linear in), and on an H200 cuBLAS changed
greedy tokens (bench/RESULTS.md)."""

from __future__ import annotations

import helexa.model.transformer as transformer
from helexa.model.sampling import SamplingParams
from tests.support.engines import drive, make_engine, random_prompts
from tests.support.kernels import triton_linear

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


def _outputs(engine, prompts, stagger: int = 0) -> list[tuple[list[int], list[float]]]:
    handles = []
    for p in prompts:
        handles.append(engine.submit(p, PARAMS))
        for _ in range(stagger):
            engine.step()
    events = drive(engine, handles)
    streams = [events[h.request_id] for h in handles]
    return [([t for e in evs for t in e.token_ids], [lp.logprob for e in evs for lp in e.logprobs]) for evs in streams]


def _compositions(model_dir) -> list[list[tuple[list[int], list[float]]]]:
    prompts = random_prompts(4, seed=9)
    engine = make_engine(model_dir, attention_backend="triton", prefix_cache=False)
    alone = [_outputs(engine, [p])[0] for p in prompts]
    together = _outputs(engine, prompts)
    staggered = _outputs(engine, prompts, stagger=2)
    chunked = _outputs(make_engine(model_dir, attention_backend="triton", prefix_cache=False, max_num_batched_tokens=8),
                       prompts)  # fmt: skip
    return [alone, together, staggered, chunked]


def test_with_the_cuda_matmul_every_composition_gives_the_same_bits(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(transformer, "linear", triton_linear)
    alone, *others = _compositions(tiny_model_dir)
    assert all(len(tokens) == PARAMS.max_tokens for tokens, _ in alone)
    for other in others:
        assert other == alone
