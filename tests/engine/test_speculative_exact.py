"""Speculative decoding on the default model (its GGUF on the fused CPU step): drafts change how many tokens
a step produces, never which. Greedy and seeded requests give the same tokens, logprobs, text and finish
reasons with and without drafts, alone or batched, with penalties, stop strings, EOS, a near limit and a
grammar; unseeded ones are drawn from the same distribution; every step keeps the block invariants, and
what the prefix cache indexes is only K/V a request kept."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

from helexa.engine.engine import Engine
from helexa.engine.speculative import DraftState
from helexa.engine.step_budget import StepEstimate
from helexa.model.sampling import SamplingParams
from helexa.model.sampling.grammar import json_schema_grammar
from tests.support.engines import assert_released, cpu_config, drive

pytestmark = pytest.mark.default_model

SOURCE = inspect.getsource(textwrap.dedent)[:1200]  # real code the model is asked to copy


# What the engine predicts a step costs: a decode step 50 ms, a verified row or prompt token 0.5 ms of it.
PINNED_COST = StepEstimate(decode_seconds=0.05, per_token=0.0005, full_rate=0.0005)


def _engine(model_dir, speculative: str = "suffix", **overrides) -> Engine:
    """The default model's engine, its step costs pinned: draft lengths follow the step times the engine
    measures, which move with the machine's load, so what these tests draft and keep would too."""
    args = dict(num_blocks=160, block_size=16, max_num_batched_tokens=512, speculative=speculative)
    engine = Engine(cpu_config(model_dir, **{**args, **overrides}))
    engine.step_cost.estimate = lambda: PINNED_COST  # type: ignore[method-assign]
    return engine


def _chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def _copy_prompt(engine: Engine) -> list[int]:
    return _chat(engine, f"Here is a function:\n```python\n{SOURCE}\n```\nRepeat it exactly, then stop.")


def _outcome(events: list) -> tuple:
    """Everything a client sees of one request: token ids, per token (id, logprob, top), text, finish reason."""
    ids = [t for e in events for t in e.token_ids]
    logprobs = [(lp.token_id, lp.logprob, lp.top) for e in events for lp in e.logprobs]
    return ids, logprobs, "".join(e.text for e in events), events[-1].finish_reason


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
    events = drive(engine, handles, max_steps=4000)  # every invariant checked after every step
    assert_released(engine)
    return [_outcome(events[h.request_id]) for h in handles]


PARAMS = [
    SamplingParams(max_tokens=96, temperature=0.0, logprobs=3),
    SamplingParams(max_tokens=80, temperature=0.8, top_p=0.9, seed=7, logprobs=2),
    SamplingParams(max_tokens=64, temperature=0.7, seed=3, frequency_penalty=0.4, repetition_penalty=1.1),
    SamplingParams(max_tokens=96, temperature=0.0, stop=["return"]),
    SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),  # near its limit: drafts at most 1 token
]


def test_drafts_leave_every_token_logprob_and_finish_unchanged(default_model_dir) -> None:
    """Each request alone without drafts is the reference; all of them batched with drafts (and also
    alone with drafts) give exactly it, and the drafts were really verified and mostly kept."""
    reference_engine = _engine(default_model_dir, "off")
    prompt = _copy_prompt(reference_engine)
    want = [_run(reference_engine, [prompt], [sp])[0] for sp in PARAMS]
    engine = _engine(default_model_dir)
    assert _run(engine, [prompt] * len(PARAMS), PARAMS) == want
    stats = engine.drafter.stats
    assert stats.drafts > 10 and stats.accepted_tokens > stats.drafts  # more than one kept token per draft
    assert [_run(_engine(default_model_dir, "ngram"), [prompt], [sp])[0] for sp in PARAMS[:2]] == want[:2]
    assert want[3][3] == "stop" and want[4][3] == "length" and len(want[4][0]) == 3


def test_a_grammar_refuses_draft_tokens_it_does_not_allow(default_model_dir) -> None:
    """A JSON-schema request whose prompt holds JSON to copy: drafts are cut at what the grammar allows
    and verified under its masks; the output is the one without drafts, and valid."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    example = '{"name":"helexa","tags":["paged","kv","cache","admission","triton","agents"]}'
    params = [SamplingParams(max_tokens=60, temperature=0.0, grammar=json_schema_grammar(schema), logprobs=1)]
    reference = _engine(default_model_dir, "off")
    prompt = _chat(reference, f"Copy this JSON exactly: {example} {example}")
    want = _run(reference, [prompt], params)
    engine = _engine(default_model_dir)
    assert _run(engine, [prompt], params) == want
    assert engine.drafter.stats.drafts > 0
    assert want[0][3] == "stop" and want[0][2].startswith('{"name":')


def test_rejected_positions_never_reach_the_prefix_cache(default_model_dir) -> None:
    """Small blocks (4 tokens) and the adaptive policy: drafts cross block edges and most steps reject
    part of one. A second turn that resends the first turn's prompt and answer hits the cache for them
    and answers exactly as a cold engine without drafts does: nothing stale was indexed."""
    small = dict(block_size=4, num_blocks=400, policy="adaptive")
    engine = _engine(default_model_dir, **small)
    prompt = _copy_prompt(engine)
    greedy = [SamplingParams(max_tokens=48, temperature=0.0)]
    first = _run(engine, [prompt], greedy)[0]
    second_prompt = prompt + first[0] + _chat(engine, "Now once more.")[1:]
    hits = engine.counters.prefix_cache_hit_tokens
    second = _run(engine, [second_prompt], greedy)[0]
    assert engine.counters.prefix_cache_hit_tokens - hits >= len(prompt) + len(first[0]) - 4
    cold = _engine(default_model_dir, "off", **small)
    assert second == _run(cold, [second_prompt], greedy)[0]
    assert engine.drafter.stats.draft_tokens > engine.drafter.stats.accepted_tokens > 0


def test_the_float_reference_gives_the_same_greedy_tokens_with_drafts(default_model_dir) -> None:
    """`--quantization none` (the torch layers): greedy tokens with drafts are those without."""
    off = _engine(default_model_dir, "off", quantization="none")
    prompt = _copy_prompt(off)
    greedy = [SamplingParams(max_tokens=40, temperature=0.0)]
    on = _engine(default_model_dir, quantization="none")
    assert _run(on, [prompt], greedy)[0][0] == _run(off, [prompt], greedy)[0][0]
    assert on.drafter.stats.accepted_tokens > 0


def _chi_square_p(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test of equal distributions (categories with fewer than 10 in all pooled)."""
    keys = sorted(set(a) | set(b))
    counts = [(a.count(k), b.count(k)) for k in keys]
    big = [c for c in counts if sum(c) >= 10]
    rest = (sum(x for x, _ in counts) - sum(x for x, _ in big), sum(y for _, y in counts) - sum(y for _, y in big))
    cells = big + ([rest] if sum(rest) else [])
    na, nb = len(a), len(b)
    stat = sum((x * (nb / na) ** 0.5 - y * (na / nb) ** 0.5) ** 2 / (x + y) for x, y in cells)
    df = torch.tensor((len(cells) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


def test_unseeded_sampling_draws_from_the_same_distribution(default_model_dir, monkeypatch) -> None:
    """160 unseeded requests (temperature 0.7, top-k 8) on a prompt that repeats a pattern, every decode drafting
    (the length pinned, whatever 32 streams make a row cost), so drafts are verified and partly rejected:
    the second, third and fourth tokens' distributions with drafts match those without (chi-square;
    the engines' generators are seeded, so the test is repeatable)."""
    monkeypatch.setattr(DraftState, "next_length", lambda self, row_cost=0.0: self.max_length)
    params = [SamplingParams(max_tokens=4, temperature=0.7, top_k=8, ignore_eos=True)] * 160
    samples = {}
    for mode in ("off", "ngram"):
        engine = _engine(default_model_dir, mode, num_blocks=400, max_num_seqs=32, max_num_batched_tokens=512)
        prompt = engine.tokenizer.encode(
            "red green blue red green blue red green blue red green", add_special_tokens=False
        )
        samples[mode] = [tuple(ids[1:]) for ids, *_ in _run(engine, [prompt] * len(params), params)]
        if mode == "ngram":
            stats = engine.drafter.stats
            assert 0 < stats.accepted_tokens < stats.draft_tokens  # drafts kept and rejected
    for position in range(3):  # each drafted position's tokens: a real distribution, the same with drafts
        off, on = ([ids[position] for ids in samples[mode]] for mode in ("off", "ngram"))
        assert len(set(off)) > 2
        assert _chi_square_p(off, on) > 1e-3
