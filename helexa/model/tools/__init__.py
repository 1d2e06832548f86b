"""helexa.model.tools: function calling — tool declarations, the formats models write calls in
(streaming parsers), conversations with tools made ready for a chat template, and forced calls."""

from helexa.model.tools.calls import ToolCall, ToolSpecError, new_call_id, read_tools, tool_names
from helexa.model.tools.forcing import forced_call_grammar
from helexa.model.tools.parsers import PARSERS, Item, ToolCallParser, detect_format, parse_all
from helexa.model.tools.prompting import prepare_conversation, tools_system_prompt

__all__ = [
    "PARSERS",
    "Item",
    "ToolCall",
    "ToolCallParser",
    "ToolSpecError",
    "detect_format",
    "forced_call_grammar",
    "new_call_id",
    "parse_all",
    "prepare_conversation",
    "read_tools",
    "tool_names",
    "tools_system_prompt",
]
