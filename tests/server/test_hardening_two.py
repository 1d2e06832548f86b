"""The second hardening round (issue 31), through a real server on 127.0.0.1: everything that reaches the
chat template is counted before rendering or tokenising, and the number of tools is bounded."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from helexa.server.protocol import MAX_TOOLS
from tests.server.test_hardening import _error
from tests.support.servers import RunningServer


def _tool(i: int, description: str = "") -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "description": description, "parameters": {}}}


def test_more_tools_than_openai_allows_is_a_400_naming_tools(server: RunningServer) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    too_many = [_tool(i) for i in range(MAX_TOOLS + 1)]
    response = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "tools": too_many}, timeout=30)
    error = _error(response, 400, "invalid_request")
    assert error["param"] == "tools" and f"at most {MAX_TOOLS}" in error["message"]
    at_limit = httpx.post(
        f"{server.url}/v1/chat/completions", json={**body, "tools": [_tool(i) for i in range(MAX_TOOLS)]}, timeout=30
    )  # allowed: then counted as a prompt (128 tools' schemas are ~12k tokens, over this model's 2k context)
    assert _error(at_limit, 400, "context_length_exceeded")["param"] == "messages"


@pytest.mark.parametrize("where", ["tools", "tool_result", "tool_call"])
def test_tools_and_tool_results_are_counted_before_the_template(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Issue 31: 7.2 MB of tool descriptions were tokenised in full before the 400. Now the text check counts
    the tools, tool calls and tool results, and refuses before the template is rendered or anything tokenised."""
    rendered: list[int] = []
    tokenizer = server.engine.tokenizer
    real = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: rendered.append(1) or real(*a, **k))
    limit = server.engine.max_model_len * tokenizer.max_token_bytes
    big = "describe the tool at length " * (limit // 28 + 10)  # one field alone is over the limit
    messages: list[dict] = [{"role": "user", "content": "hi"}]
    tools = [_tool(0)]
    if where == "tools":
        tools = [_tool(0, big)]
    elif where == "tool_result":
        messages += [
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "f0", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": big},
        ]  # fmt: skip
    else:
        call = {"id": "c1", "type": "function", "function": {"name": "f0", "arguments": json.dumps({"t": big})}}
        messages += [{"role": "assistant", "tool_calls": [call]}]
    started = time.monotonic()
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "m", "messages": messages, "tools": tools, "max_tokens": 2},
        timeout=60,
    )
    error = _error(response, 400, "context_length_exceeded")
    assert "bytes of text cannot fit" in error["message"], error
    assert error["param"] == ("tools" if where == "tools" else "messages")
    assert rendered == [], "the template rendered (and the prompt was tokenised) before the size check"
    print(f"refused {where} in {time.monotonic() - started:.3f} s")


def test_a_schema_over_the_compile_budget_is_a_400_naming_the_field(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compile's time budget (5 s by default; a millisecond here): a 400 naming `response_format`, and the
    node keeps serving. The compile itself runs on, off the event loop, and its result is kept for next time."""
    monkeypatch.setattr(server.app.state.helexa.grammars, "budget_secs", 0.001)
    schema = {"anyOf": [{"type": "object", "properties": {f"slow{i}": {"type": "integer"}}} for i in range(1500)]}
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    error = _error(response, 400, "invalid_request")
    assert error["param"] == "response_format" and "did not compile within" in error["message"], error
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
