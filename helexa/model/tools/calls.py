"""Function tools as the OpenAI API declares them, and the calls a model makes to them.

`read_tools(value, param)` checks a request's `tools` (chat shape `{"type": "function", "function":
{...}}`, or the Responses API's flat `{"type": "function", "name": ...}`) and returns them in the chat
shape chat templates take; `ToolCall` is one parsed call, its `arguments` the JSON text of an object.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

__all__ = ["ToolCall", "ToolSpecError", "new_call_id", "read_tools", "tool_names"]

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")  # OpenAI: letters, digits, _ and -, at most 64; a little looser


class ToolSpecError(ValueError):
    """A malformed tool declaration; `param` names where (`tools[2].function.name`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `id` (unique per response), the declared function's `name`, and its
    `arguments` as the JSON text of an object (as the OpenAI API carries them)."""

    id: str
    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """The chat API's `tool_calls` entry (with `index`: the streamed delta's)."""
        entry: dict[str, Any] = {} if index is None else {"index": index}
        entry.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        return entry


def new_call_id(style: str = "openai") -> str:
    """A fresh call id: `call_` and 24 hex digits, or (`style` "mistral") the 9 letters and digits Mistral's
    templates require."""
    if style == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


def read_tools(value: Any, param: str = "tools") -> list[dict[str, Any]]:
    """`value` as a list of chat-shaped function tools, each `{"type": "function", "function": {"name",
    "description"?, "parameters", "strict"?}}` (`parameters` defaults to an object with no properties).
    Raises `ToolSpecError` naming the first bad entry; names must be unique."""
    if not isinstance(value, list):
        raise ToolSpecError(f"'{param}' must be a list of function tools", param)
    tools: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolSpecError(f"{where} must be a function tool ({{'type': 'function', ...}})", where)
        nested = "function" in tool
        function = tool["function"] if nested else tool  # the Responses API declares functions flat
        fwhere = f"{where}.function" if nested else where
        if not isinstance(function, dict):
            raise ToolSpecError(f"{fwhere} must be an object", fwhere)
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolSpecError(
                f"{fwhere}.name must be 1-128 letters, digits, '_', '-', '.' or ':', got {json.dumps(name)[:80]}",
                f"{fwhere}.name",
            )
        if name in seen:
            raise ToolSpecError(f"{fwhere}.name {name!r} is declared twice", f"{fwhere}.name")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolSpecError(f"{fwhere}.description must be a string", f"{fwhere}.description")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ToolSpecError(f"{fwhere}.parameters must be a JSON schema object", f"{fwhere}.parameters")
        spec: dict[str, Any] = {"name": name}
        if description is not None:
            spec["description"] = description
        spec["parameters"] = parameters
        if isinstance(function.get("strict"), bool):
            spec["strict"] = function["strict"]
        tools.append({"type": "function", "function": spec})
    return tools


def tool_names(tools: list[dict[str, Any]] | None) -> frozenset[str]:
    """The function names of chat-shaped `tools`."""
    return frozenset(t["function"]["name"] for t in tools or ())
