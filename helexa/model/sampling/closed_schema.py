"""Closed objects: a JSON schema whose objects accept only the properties they declare.

JSON Schema's default lets an object carry any key it does not declare, so a grammar built from an
open schema lets a small model invent keys and never close the object. OpenAI closes every object
under `strict: true`, and vLLM's default backend closes them even without it; helexa closes the
objects of forced tool calls' arguments and of `strict` formats always, and of other `response_format`
schemas unless the server runs with `--allow-additional-properties`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["close_objects"]

# Keywords whose value is one subschema, a list of subschemas, or a map of names to subschemas.
_ONE = ("additionalItems", "contains", "else", "if", "items", "not", "propertyNames", "then", "unevaluatedItems")
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("$defs", "definitions", "dependentSchemas", "patternProperties", "properties")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema that declares `properties` and says nothing of
    extra keys (no `additionalProperties`, `unevaluatedProperties` or `patternProperties`) gets
    `"additionalProperties": false`. Subschemas are found through the keywords that hold them (so a
    property *named* `properties` is never mistaken for the keyword); `additionalProperties` given as a
    schema is closed inside too. Anything that is not a schema object (`true`, `false`) is returned as is.
    An object with no `properties` (`{"type": "object"}`, any JSON object) stays open."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(item) for item in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = close_objects(out["additionalProperties"])
    says_extra = any(k in out for k in ("additionalProperties", "unevaluatedProperties", "patternProperties"))
    if isinstance(out.get("properties"), dict) and not says_extra:
        out["additionalProperties"] = False
    return out
