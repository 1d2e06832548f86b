"""Forced tool calls: a grammar under which the output can only be calls, in the model's format, to the
allowed tools, with arguments valid under each tool's JSON schema (`tool_choice` "required" or a named
function). Compiled by llguidance like structured output; the parser reads the result back."""

from __future__ import annotations

import json
from typing import Any

from helexa.model.sampling.closed_schema import close_objects
from helexa.model.sampling.grammar import GrammarError, json_schema_grammar, lark_grammar
from helexa.model.tools.calls import ToolSpecError
from helexa.model.tools.parsers import Llama3JsonParser, ToolCallParser

__all__ = ["forced_call_grammar"]


def _call_schema(tool: dict[str, Any], args_key: str) -> dict[str, Any]:
    """One call's JSON: the tool's name and its arguments, every object in them closed (`close_objects`)."""
    function = tool["function"]
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, args_key: close_objects(function["parameters"])},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _compact(schema: dict[str, Any] | bool) -> str:
    """`schema` as the JSON text of a Lark `%json` item whose values are written compactly (no whitespace)."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": schema.get("x-guidance", {"whitespace_flexible": False})}
    return json.dumps(schema, ensure_ascii=False)


def forced_call_grammar(
    tools: list[dict[str, Any]],
    parser: type[ToolCallParser],
    only: str | None = None,
    parallel: bool = True,
    marker_token: int | None = None,
    or_text: dict[str, Any] | bool | None = None,
) -> str:
    """The grammar of one call (or, with `parallel`, one or more) to `tools` (chat-shaped, as
    `read_tools` returns them) — to the tool named `only` when given — in `parser`'s format. Each
    call's arguments accept only the properties their schema declares (objects are closed). The answer
    may end after any complete call. With `or_text` (a JSON schema: `tool_choice` "auto" beside an output
    format), the answer is either those calls or JSON text valid under it: the format governs text only.

    Raises `ToolSpecError` naming `tools[i].function.parameters` when a tool's schema cannot be compiled,
    and naming `tool_choice` when `only` is not a declared tool."""
    indexed = [(i, t) for i, t in enumerate(tools) if only is None or t["function"]["name"] == only]
    if not indexed:
        raise ToolSpecError(f"tool_choice names the function {only!r}, which 'tools' does not declare", "tool_choice")
    for i, tool in indexed:
        try:
            json_schema_grammar(tool["function"]["parameters"])
        except GrammarError as exc:
            raise ToolSpecError(f"tools[{i}].function.parameters: {exc}", f"tools[{i}].function.parameters") from None
    args_key = "parameters" if parser is Llama3JsonParser else "arguments"
    options = [_call_schema(t, args_key) for _, t in indexed]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    call_json = f"%json {_compact(schema)}"
    start = "start: calls\n" if or_text is None else f"start: calls | text\ntext: %json {_compact(or_text)}\n"
    try:
        return lark_grammar(start + parser.call_grammar(call_json, parallel, marker_token))
    except GrammarError as exc:
        raise ToolSpecError(f"the tools cannot be forced: {exc}", "tools") from None
