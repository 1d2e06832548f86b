"""Tool calling through the HTTP API with the official client: forced calls are valid calls to declared
tools, streamed as tool-call deltas; an agent loop's history (tool calls with null content, tool results)
renders; bad declarations are 400s naming the param."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.support.servers import RunningServer

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}, "days": {"type": "integer", "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "noop", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _check_calls(calls, only: str | None = None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in SCHEMAS and (only is None or call.function.name == only)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_tool_choice_forces_a_valid_call(client: openai.OpenAI, seed: int) -> None:
    reply = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=120, temperature=1.0, seed=seed,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls)


def test_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice=named, parallel_tool_calls=False, max_tokens=120, seed=4
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    _check_calls(reply.choices[0].message.tool_calls, only="get_weather")


def test_streamed_tool_call_deltas_add_up_to_the_same_call(client: openai.OpenAI) -> None:
    kwargs = dict(model="m", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=120, temperature=0.0)  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert [d.index for d in deltas] == [0] and deltas[0].id.startswith("call_")
    assert (deltas[0].function.name, deltas[0].function.arguments) == (
        whole.message.tool_calls[0].function.name,
        whole.message.tool_calls[0].function.arguments,
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    with client.chat.completions.stream(**kwargs) as stream:  # the SDK's own accumulator
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert final.message.tool_calls[0].function.arguments == whole.message.tool_calls[0].function.arguments


def test_an_agent_loop_continues_after_a_tool_result(client: openai.OpenAI) -> None:
    """Call, answer with a `tool` message, continue: the history an agent harness sends, unchanged."""
    messages: list = [{"role": "system", "content": "You can look up the weather."}, *ASK]
    reply = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120
    )
    first = reply.choices[0]
    call = first.message.tool_calls[0]
    messages.append(first.message.model_dump(exclude_none=False))  # content: None, as the SDK keeps it
    assert messages[-1]["content"] is None
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18})})
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=8, seed=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > reply.usage.prompt_tokens  # the history grew by the call and its result
    none = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert none.choices[0].message.tool_calls in (None, []) and none.choices[0].finish_reason in ("stop", "length")


def test_responses_function_calls(client: openai.OpenAI) -> None:
    flat = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
    resp = client.responses.create(
        model="m", input="Weather?", tools=flat, tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=120, temperature=0,
    )  # fmt: skip
    assert resp.status == "completed" and [o.type for o in resp.output] == ["function_call"]
    call = resp.output[0]
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    events = list(
        client.responses.create(
            model="m", input="Weather?", tools=flat, tool_choice="required", parallel_tool_calls=False,
            max_output_tokens=120, temperature=0, stream=True,
        )
    )  # fmt: skip
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].arguments == call.arguments
    # the loop's next turn: the call and its output as input items
    follow = client.responses.create(
        model="m",
        input=[
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        tools=flat,
        max_output_tokens=6,
    )
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > resp.usage.input_tokens


def test_auto_leaves_plain_text_as_content(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=12, temperature=0)
    plain = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=12,
                                           temperature=0)  # fmt: skip
    choice = reply.choices[0]
    if not choice.message.tool_calls:  # a random model writes text: it arrives as content, not lost
        assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert plain.choices[0].message.content is not None


@pytest.mark.parametrize(
    "path, extra, param",
    [
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
        ),
        (
            "/v1/chat/completions",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "zzz"}}},
            "tool_choice",
        ),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        (
            "/v1/chat/completions",
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "xml"}},
            "response_format",
        ),
        ("/v1/responses", {"tools": [{"type": "function", "name": 5}]}, "tools[0].name"),
        ("/v1/responses", {"tools": TOOLS, "tool_choice": {"type": "function", "name": "zzz"}}, "tool_choice"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_param(server: RunningServer, path: str, extra: dict, param: str) -> None:
    body = {"model": "m", "max_tokens": 4, **extra}
    body.update({"messages": ASK} if path.endswith("completions") else {"input": "hi"})
    response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "message, param",
    [
        ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
         "messages"),
        ({"role": "assistant", "tool_calls": "nope"}, "messages"),
    ],
)  # fmt: skip
def test_bad_history_is_a_400(server: RunningServer, message: dict, param: str) -> None:
    body = {"model": "m", "messages": [*ASK, message], "max_tokens": 4}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert "tool_calls" in response.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_whose_argument_holds_the_closing_marker_is_a_call(server: RunningServer, stream: bool) -> None:
    """Issue 31: the grammar forces an argument value holding `</tool_call>`; the answer is still one call
    with that value (the parser reads the call's JSON as JSON), never `tool_calls: []` with the markup as text."""
    value = "a</tool_call>b"
    tools = [{"type": "function", "function": {"name": "echo", "parameters": {
        "type": "object", "properties": {"s": {"const": value}}, "required": ["s"]}}}]  # fmt: skip
    body = {"model": "m", "messages": ASK, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 120, "seed": 5, "stream": stream}  # fmt: skip
    if not stream:
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
        calls = [c["function"] for c in choice["message"]["tool_calls"]]
    else:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        assert deltas[-1]["finish_reason"] == "tool_calls"
        assert not any(d["delta"].get("content") for d in deltas)
        pieces = [tc for d in deltas for tc in d["delta"].get("tool_calls") or ()]
        arguments = "".join(p["function"]["arguments"] for p in pieces)
        calls = [{"name": pieces[0]["function"]["name"], "arguments": arguments}]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("echo", {"s": value})]
