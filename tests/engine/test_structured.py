"""Structured output in the engine: every constrained answer parses and validates; free rows are untouched."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest

from helexa.model.sampling import SamplingParams
from helexa.model.sampling.grammar import GrammarError, json_schema_grammar
from tests.support.engines import assert_released, drive, make_engine, tokens

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b", "c"]}},
     "required": ["ok", "kind"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 5},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
        "required": ["name", "tags"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"$defs": {"color": {"enum": ["red", "green"]}}, "type": "object",
     "properties": {"fg": {"$ref": "#/$defs/color"}, "bg": {"$ref": "#/$defs/color"}},
     "required": ["fg", "bg"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
]  # fmt: skip


@pytest.mark.parametrize("schema", SCHEMAS, ids=["enum", "nested", "defs", "array"])
def test_constrained_answers_validate_under_their_schema(tiny_model_dir, schema) -> None:
    engine = make_engine(tiny_model_dir, num_blocks=128)
    grammar = json_schema_grammar(schema)
    params = [SamplingParams(max_tokens=80, temperature=0.0, grammar=grammar)] + [
        SamplingParams(max_tokens=80, temperature=1.0, seed=s, grammar=grammar) for s in range(3)
    ]
    handles = [engine.submit([5 + i, 9, 11, 40], p) for i, p in enumerate(params)]
    events = drive(engine, handles)
    for h in handles:
        text = "".join(e.text for e in events[h.request_id])
        assert events[h.request_id][-1].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert_released(engine)


def test_free_rows_in_a_mixed_batch_are_unchanged(tiny_model_dir) -> None:
    free = [([7, 8, 9, 10], SamplingParams(max_tokens=12, temperature=0.0)),
            ([21, 22], SamplingParams(max_tokens=12, temperature=0.8, seed=3))]  # fmt: skip
    alone = make_engine(tiny_model_dir, num_blocks=128)
    handles = [alone.submit(p, sp) for p, sp in free]
    ref = drive(alone, handles)
    expected = [tokens(ref[h.request_id]) for h in handles]
    mixed = make_engine(tiny_model_dir, num_blocks=128)
    grammar = json_schema_grammar(SCHEMAS[0])
    constrained = [mixed.submit([30 + i], SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar))
                   for i in range(3)]  # fmt: skip
    handles = [mixed.submit(p, sp) for p, sp in free]
    got = drive(mixed, [*constrained, *handles])
    assert [tokens(got[h.request_id]) for h in handles] == expected


def test_bad_schemas_and_grammars_are_refused(tiny_model_dir) -> None:
    with pytest.raises(GrammarError, match="invalid JSON schema"):
        json_schema_grammar({"type": "objekt"})
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(grammar="")
    engine = make_engine(tiny_model_dir)
    with pytest.raises(GrammarError):
        engine.submit([5, 6], SamplingParams(grammar="not a grammar at all"))
    assert_released(engine)


def test_a_row_whose_own_bias_fails_leaves_the_constrained_rows_of_its_batch_masked(tiny_model_dir) -> None:
    """The runner's per-row fallback (one row's sampling fails) still masks each constrained row with its own
    grammar, and their logprobs are the model's own (finite)."""
    engine = make_engine(tiny_model_dir, num_blocks=128)
    grammar = json_schema_grammar(SCHEMAS[0])
    bad = engine.submit([3, 4, 5], SamplingParams(max_tokens=8, logit_bias={10**6: 1.0}))  # beyond the vocabulary
    good = [engine.submit([30 + i], SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar, logprobs=3))
            for i in range(2)]  # fmt: skip
    events = drive(engine, [bad, *good])
    assert events[bad.request_id][-1].finish_reason == "error"
    assert "logit_bias" in str(events[bad.request_id][-1].error)
    for h in good:
        text = "".join(e.text for e in events[h.request_id])
        jsonschema.validate(json.loads(text), SCHEMAS[0])
        logprobs = [lp for e in events[h.request_id] for lp in e.logprobs]
        assert logprobs and all(math.isfinite(v) for lp in logprobs for v in (lp.logprob, *(t for _, t in lp.top)))
    assert_released(engine)
