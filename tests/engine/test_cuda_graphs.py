"""Decode steps replayed from per-bucket graphs (`helexa.engine.cuda_graphs`), on the CPU: the graph is
stood in for by a capture that replays by running the forward again into the same output, so the static
buffers, the padding up to the bucket, the bucket choice and the eager fallback are all exercised. With
the CUDA step's batch-invariant kernels (Triton attention and the Triton dense matmul, in the
interpreter) every token and logprob equals the eager engine's, bit for bit."""

from __future__ import annotations

import logging

import pytest

import helexa.model.transformer as transformer
from helexa.engine.cuda_graphs import DecodeGraphs, buckets_for
from helexa.model.sampling import SamplingParams
from tests.support.engines import assert_released, drive, make_engine, random_prompts
from tests.support.kernels import triton_linear

PARAMS = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=0)


def _replaying(run):
    """A graph's stand-in: the output tensor of a first run, rewritten in place by each replay."""
    out = run()

    def replay() -> None:
        out.copy_(run())

    return replay, out


def _failing(run):
    raise RuntimeError("capture refused (test)")


PROMPTS = random_prompts(3, seed=12)


@pytest.fixture
def cuda_step(monkeypatch):
    monkeypatch.setattr(transformer, "linear", triton_linear)


@pytest.fixture(scope="module")
def eager(tiny_model_dir):
    """The eager engine's streams of PROMPTS on the CUDA step's kernels, computed once for the module (each run
    of the step in the interpreter takes ~20 s on two cores)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformer, "linear", triton_linear)
        return _streams(_engine(tiny_model_dir), PROMPTS)


def _engine(model_dir, capture=None):
    engine = make_engine(model_dir, attention_backend="triton", prefix_cache=False, speculative="off")
    if capture is not None:
        engine.runner.use_cuda_graphs(8, engine.max_model_len, capture=capture)
    return engine


def _streams(engine, prompts):
    handles = [engine.submit(p, PARAMS) for p in prompts]
    events = drive(engine, handles)
    assert_released(engine)
    streams = [events[h.request_id] for h in handles]
    return [([t for e in evs for t in e.token_ids], [lp.logprob for e in evs for lp in e.logprobs]) for evs in streams]


def test_buckets_cover_every_batch_size_with_little_padding():
    for max_num_seqs in (1, 3, 8, 64, 100, 256):
        buckets = buckets_for(max_num_seqs)
        assert buckets[0] == 1 and buckets[-1] == max_num_seqs and list(buckets) == sorted(set(buckets))
        for b in range(1, max_num_seqs + 1):
            size = next(s for s in buckets if s >= b)
            assert size - b < (b if size <= 8 else 8 if size <= 64 else 32), (max_num_seqs, b, size)


def test_replayed_decode_steps_give_the_eager_engine_s_bits(tiny_model_dir, cuda_step, eager):
    engine = _engine(tiny_model_dir, capture=_replaying)
    graphs = engine.runner.graphs
    assert isinstance(graphs, DecodeGraphs)
    assert _streams(engine, PROMPTS) == eager
    # 3 decoding sequences replay the bucket of 4 (one padded row); fewer as they end, never a prefill
    assert graphs.replays >= PARAMS.max_tokens - 2 and 4 in graphs._graphs and graphs.disabled is None
    again = _streams(engine, PROMPTS[:1])  # a later step of one sequence: bucket 1, captured on first use
    assert again == eager[:1] and 1 in graphs._graphs


def test_a_failed_capture_turns_graphs_off_and_the_step_runs_eagerly(tiny_model_dir, cuda_step, eager, caplog):
    engine = _engine(tiny_model_dir, capture=_failing)
    with caplog.at_level(logging.WARNING, logger="helexa.engine.cuda_graphs"):
        assert _streams(engine, PROMPTS) == eager
    assert engine.runner.graphs.disabled == "RuntimeError: capture refused (test)"
    assert engine.runner.graphs.replays == 0
    assert sum("CUDA graph capture failed" in r.message for r in caplog.records) == 1


def test_a_cpu_engine_runs_eagerly_and_enforce_eager_is_a_flag(tiny_model_dir):
    assert make_engine(tiny_model_dir).runner.graphs is None  # graphs are for CUDA
    assert make_engine(tiny_model_dir, enforce_eager=True).config.enforce_eager is True
