"""Rows whose token is the argmax of their raw logits and that want nothing else of them (greedy; no logprobs,
penalties, logit_bias or grammar: `SamplingParams.takes_argmax`) take their token in the fused CPU step: the
runner hands them to the forward as argmax rows, over the tokenizer's columns only, and their logits are never
stored. Batched with rows that are sampled from logits, and verifying drafts, every request gets exactly what
it gets when every row's logits go to the sampler."""

from __future__ import annotations

import pytest

from helexa.engine.engine import Engine
from helexa.engine.runner import ModelRunner
from helexa.engine.step_budget import StepEstimate
from helexa.model.quant import native
from helexa.model.sampling import SamplingParams
from tests.support.engines import assert_released, drive, make_engine

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.unavailable_reason()}")

PINNED_COST = StepEstimate(decode_seconds=0.05, per_token=0.0005, full_rate=0.0005)  # drafts follow step costs
PARAMS = [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),  # argmax rows
    SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, speculative=False),  # argmax rows, no drafts
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2),  # sampled: logprobs
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, frequency_penalty=0.5),  # sampled: penalty
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logit_bias={7: 3.0}),  # sampled: bias
    SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True),  # sampled: drawn
]


def _engine(model_dir) -> Engine:
    engine = make_engine(model_dir, quantization="int4", speculative="suffix")
    engine.step_cost.estimate = lambda: PINNED_COST  # type: ignore[method-assign]
    return engine


def _run(engine: Engine) -> tuple[list[tuple], dict[str, int]]:
    """Each request's (token ids, (id, logprob, top) per token, finish reason), and how many rows went to the
    sampler and to the step's argmax over the run."""
    counts = {"sampled": 0, "argmax": 0}
    model, sampler = engine.runner.model, engine.runner.sampler
    forward_rows, sample = model.forward_rows, sampler.sample

    def counting_forward(*args, **kwargs):
        argmax = args[5] if len(args) > 5 else kwargs.get("argmax_indices")
        counts["argmax"] += 0 if argmax is None else argmax.shape[0]
        return forward_rows(*args, **kwargs)

    def counting_sample(logits, *args, **kwargs):
        counts["sampled"] += logits.shape[0]
        return sample(logits, *args, **kwargs)

    model.forward_rows, sampler.sample = counting_forward, counting_sample
    prompts = [[3 + i, 40, 41, 42, 43, 44] * 5 for i in range(len(PARAMS))]  # repeats: the drafter proposes
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, PARAMS)]
    events = drive(engine, handles)
    assert_released(engine)
    outcomes = [
        (
            [t for e in events[h.request_id] for t in e.token_ids],
            [(lp.token_id, lp.logprob, lp.top) for e in events[h.request_id] for lp in e.logprobs],
            events[h.request_id][-1].finish_reason,
        )
        for h in handles
    ]
    return outcomes, counts


def test_greedy_rows_take_their_token_in_the_step_and_nothing_changes(tiny_model_dir, monkeypatch) -> None:
    engine = _engine(tiny_model_dir)
    assert engine.runner.argmax_in_step
    assert engine.runner.sample_vocab_size < engine.runner.model.config.vocab_size  # the argmax sees fewer columns
    got, counts = _run(engine)
    assert engine.drafter is not None and engine.drafter.stats.accepted_tokens > 0
    monkeypatch.setattr(ModelRunner, "argmax_in_step", property(lambda self: False))
    want, every_row_sampled = _run(_engine(tiny_model_dir))
    assert got == want
    assert all(len(ids) == sp.max_tokens for (ids, _, _), sp in zip(got, PARAMS))
    assert counts["argmax"] > 0 and every_row_sampled["argmax"] == 0
    # The two greedy requests' rows never reached the sampler (a prefill's last row included).
    assert counts["sampled"] < every_row_sampled["sampled"]
