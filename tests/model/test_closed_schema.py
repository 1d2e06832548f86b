"""close_objects: every object that declares properties is closed, through every keyword holding subschemas."""

from __future__ import annotations

import jsonschema
import pytest

from helexa.model.sampling.closed_schema import close_objects
from helexa.model.sampling.grammar import json_schema_grammar


def test_objects_with_properties_are_closed_at_every_depth() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},  # a property *named* so
            "items": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}},
            "either": {"anyOf": [{"type": "object", "properties": {"z": {}}}, {"type": "null"}]},
            "ref": {"$ref": "#/$defs/Inner"},
        },
        "$defs": {"Inner": {"type": "object", "properties": {"w": {}}}},
    }
    closed = close_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert "additionalProperties" not in props  # the property map itself is not a schema
    assert props["properties"]["additionalProperties"] is False
    assert props["items"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["Inner"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is not changed


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object"},  # any JSON object (json_object mode) stays open
        {"type": "object", "properties": {"a": {}}, "additionalProperties": True},  # said explicitly
        {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
        True,
    ],
)
def test_what_says_nothing_of_properties_or_says_it_explicitly_is_kept(schema: object) -> None:
    assert close_objects(schema) == schema


def test_a_closed_schema_refuses_invented_keys_and_still_compiles() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    closed = close_objects(schema)
    jsonschema.validate({"city": "Paris", "properties": {"t": 1}}, schema)  # open: an invented key passes
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Paris", "properties": {"t": 1}}, closed)
    json_schema_grammar(closed)  # llguidance compiles it
