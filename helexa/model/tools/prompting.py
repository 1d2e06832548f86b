"""A conversation with tools, made ready for a model's chat template.

`prepare_conversation(messages, tools, template, parser)` returns the messages and tools to render:
- with a template that handles tools itself (it reads `tools`), both pass through unchanged (the
  template sees exactly what transformers' `apply_chat_template(..., tools=)` would be given);
- with one that does not, helexa writes them in the parser's format, as text the template can show:
  the tools and how to call them in the system message, each assistant turn's `tool_calls` appended
  to its content, and `tool` results as user turns in `<tool_response>` blocks (consecutive results
  in one turn). The model then sees its tools, and writes calls the parser reads back.

Messages here are already validated (`validate_messages`): `tool_calls[].function.arguments` are objects.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from helexa.model.text.chat_template import ChatTemplate
from helexa.model.tools.parsers import ToolCallParser

__all__ = ["prepare_conversation", "tools_system_prompt"]


def tools_system_prompt(tools: Sequence[dict[str, Any]], parser: type[ToolCallParser]) -> str:
    """The system-prompt text that declares `tools` and shows the parser's call syntax."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    example = parser.render_calls([("<function name>", {"<argument>": "<value>"})])
    return (
        "# Tools\n\n"
        "You can call these functions. Each is described by a JSON schema, one per line:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "To call a function, answer with nothing else than the call, written exactly like this:\n"
        f"{example}\n"
        "The result of each call comes back in a <tool_response> block."
    )


def _with_calls(message: dict[str, Any], parser: type[ToolCallParser]) -> dict[str, Any]:
    calls = [(c["function"]["name"], c["function"].get("arguments", {})) for c in message.get("tool_calls", ())]
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    text = "\n".join(part for part in (content, parser.render_calls(calls)) if part)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return content or ""


def prepare_conversation(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template: ChatTemplate | None,
    parser: type[ToolCallParser],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render with `template`, as the module docstring says. `tools` None (or
    empty) shows no tools; the history's calls and results are still written out."""
    if template is not None and template.uses_tools:
        return messages, tools or None
    has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not tools and not has_tool_turns:
        return messages, None
    out: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            block = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif message.get("tool_calls"):
            out.append(_with_calls(message, parser))
        else:
            out.append(message)
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if tools:
        prompt = tools_system_prompt(tools, parser)
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{_text(out[0].get('content'))}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None
