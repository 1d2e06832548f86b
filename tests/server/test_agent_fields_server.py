"""What agent frameworks send, on the tiny model: logprobs under every constraint, forced calls that end,
closed tool arguments, a format beside a forced call, logit_bias, continuous usage, model retrieve,
/tokenize with tools, the Responses format echo, and fields helexa cannot honour refused by name."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from tests.support.servers import RunningServer, wait_for

ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
CONSTRAINTS = {
    "json_schema": {"response_format": JSON_SCHEMA},
    "json_object": {"response_format": {"type": "json_object"}},
    "required": {"tools": TOOLS, "tool_choice": "required"},
    "named": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
}


def _no_eos(server: RunningServer) -> dict[str, int]:
    """A logit_bias that bans every EOS token: the model can end only where the grammar leaves nothing else."""
    return {str(t): -100 for t in server.engine.tokenizer.eos_token_ids}


def _idle(server: RunningServer) -> bool:
    snap = server.engine.snapshot()
    return snap["in_flight"] == 0 and snap["blocks_reserved"] == 0


def _finite(value: object) -> bool:
    """Every number in a decoded JSON value is finite."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_top_logprobs_under_every_constraint_are_the_models_own_and_finite(server: RunningServer, kind: str) -> None:
    body = {"model": "m", "messages": ASK, "max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 5,
            **CONSTRAINTS[kind]}  # fmt: skip
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    entries = reply.json()["choices"][0]["logprobs"]["content"]
    assert entries and _finite(reply.json())
    # Not the grammar's: a token the grammar forced keeps the probability the model gave it (< 1 somewhere),
    # and the alternatives include tokens the grammar forbade (finite, not -inf).
    assert any(e["logprob"] < -1e-3 for e in entries)
    assert all(len(e["top_logprobs"]) == 5 and e["logprob"] <= 0 for e in entries)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert "Infinity" not in "".join(lines) and "NaN" not in "".join(lines)
    assert all(_finite(json.loads(line)) for line in lines)  # strict JSON on every chunk
    assert wait_for(lambda: _idle(server), 5)


def test_a_named_tool_choice_is_exactly_one_call(server: RunningServer, client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=200, temperature=0.8, seed=3, extra_body={"logit_bias": _no_eos(server)},
        **CONSTRAINTS["named"],
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) <= {"city"}


@pytest.mark.parametrize("stream", [False, True])
def test_required_ends_at_a_repeated_call_instead_of_running_to_max_tokens(
    server: RunningServer, client: openai.OpenAI, stream: bool
) -> None:
    """With EOS banned and only `noop` (no arguments) to call, every call the model can write is the same
    one: the server must end the answer at the first repeat and drop it."""
    tools = [TOOLS[1]]
    kwargs = dict(model="m", messages=ASK, tools=tools, tool_choice="required", max_tokens=300, temperature=0,
                  extra_body={"logit_bias": _no_eos(server)})  # fmt: skip
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [c.function.name for c in choice.message.tool_calls] == ["noop"]
        assert choice.message.tool_calls[0].function.arguments == "{}"
        assert reply.usage.completion_tokens < 300
    else:
        chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
        assert [t.function.name for t in calls] == ["noop"]
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
            "tool_calls"
        ]
        assert not any(c.choices[0].delta.content for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens < 300
    assert wait_for(lambda: _idle(server), 5)  # the aborted engine request gave its blocks back


def test_forced_tool_arguments_are_closed_objects(server: RunningServer, client: openai.OpenAI) -> None:
    for seed in range(3):
        reply = client.chat.completions.create(
            model="m", messages=ASK, max_tokens=200, temperature=1.0, seed=seed, **CONSTRAINTS["named"]
        )
        for call in reply.choices[0].message.tool_calls or ():
            assert set(json.loads(call.function.arguments)) <= {"city"}  # no invented keys


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_a_format_beside_a_forced_call_is_accepted_and_the_call_wins(server: RunningServer, path: str) -> None:
    if path == "/v1/responses":
        text_format = {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}
        named: dict = {"type": "function", "name": "get_weather"}
        body = {"input": "Weather in Paris?", "max_output_tokens": 200, "text": {"format": text_format}}
    else:
        named = {"type": "function", "function": {"name": "get_weather"}}
        body = {"messages": ASK, "max_tokens": 200, "response_format": JSON_SCHEMA}
    body.update(tools=TOOLS, tool_choice=named)
    reply = httpx.post(f"{server.url}{path}", json={"model": "m", "temperature": 0, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    if path == "/v1/responses":
        [call] = [item for item in data["output"] if item["type"] == "function_call"]
        assert call["name"] == "get_weather" and data["status"] == "completed"
        assert data["text"]["format"]["type"] == "json_schema"  # the enforced format is echoed, not "text"
        assert data["text"]["format"]["schema"] == WEATHER
    else:
        [call] = data["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"


def test_logit_bias_is_applied_and_validated(server: RunningServer, client: openai.OpenAI) -> None:
    token = server.engine.tokenizer.encode(" Paris")[-1]
    forced = client.completions.create(
        model="m", prompt="hello", max_tokens=4, temperature=1.0, seed=5, logprobs=0, logit_bias={str(token): 100}
    )
    assert forced.choices[0].logprobs.tokens == [server.engine.tokenizer.decode([token])] * 4
    assert all(lp < 0 for lp in forced.choices[0].logprobs.token_logprobs)  # the model's own, before the bias
    vocab = server.engine.tokenizer.vocab_size
    for bias in ({str(vocab): 1}, {"5": 101}, {"x": 1}, {"5": "1"}, [5]):
        reply = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": ASK,
                                                                      "logit_bias": bias}, timeout=30)  # fmt: skip
        assert reply.status_code == 400, bias
        assert reply.json()["error"]["param"] == "logit_bias"
    assert wait_for(lambda: _idle(server), 5)


def test_continuous_usage_stats_put_usage_on_every_chunk(server: RunningServer, client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="m", messages=ASK, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
    )  # fmt: skip
    assert all(c.usage is not None for c in chunks)
    completion = [c.usage.completion_tokens for c in chunks]
    assert completion == sorted(completion) and completion[-1] == chunks[-1].usage.completion_tokens > 0
    assert chunks[-1].choices == []  # the final usage chunk, as with include_usage alone
    plain = list(client.chat.completions.create(model="m", messages=ASK, max_tokens=6, stream=True,
                                                stream_options={"include_usage": True}))  # fmt: skip
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage is not None


def test_models_retrieve(server: RunningServer, client: openai.OpenAI) -> None:
    name = server.engine.model_name
    model = client.models.retrieve(name)
    assert model.id == name and model.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


def test_tokenize_counts_tools_as_the_chat_route_does(server: RunningServer, client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=1)
    counted = httpx.post(f"{server.url}/tokenize", json={"messages": ASK, "tools": TOOLS}, timeout=30).json()
    bare = httpx.post(f"{server.url}/tokenize", json={"messages": ASK}, timeout=30).json()
    assert counted["count"] == reply.usage.prompt_tokens > bare["count"]
    hidden = httpx.post(f"{server.url}/tokenize", json={"messages": ASK, "tools": TOOLS, "tool_choice": "none"})
    assert hidden.json()["count"] == bare["count"]  # tool_choice "none" hides them, as in chat
    refused = httpx.post(f"{server.url}/tokenize", json={"prompt": "hi", "tools": TOOLS}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),
        ("/v1/chat/completions", "function_call", "auto"),
        ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
        ("/v1/chat/completions", "modalities", ["text", "audio"]),
        ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
        ("/v1/chat/completions", "web_search_options", {}),
        ("/v1/completions", "suffix", "tail"),
        ("/v1/responses", "background", True),
        ("/v1/responses", "conversation", "conv_1"),
        ("/v1/responses", "max_tool_calls", 2),
        ("/v1/responses", "top_logprobs", 3),
        ("/v1/responses", "include", ["message.output_text.logprobs"]),
        ("/v1/responses", "prompt", {"id": "pmpt_1"}),
    ],
)
def test_fields_helexa_cannot_honour_are_400s_naming_them(server: RunningServer, path: str, field: str,
                                                          value: object) -> None:  # fmt: skip
    body: dict = {"model": "m", "max_tokens": 2, field: value}
    body.update({"messages": ASK} if path == "/v1/chat/completions" else
                {"prompt": "hi"} if path == "/v1/completions" else {"input": "hi"})  # fmt: skip
    reply = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field


@pytest.mark.parametrize("kind", [None, *CONSTRAINTS])
def test_every_combination_of_constraint_logprobs_stream_n_and_bias_is_served(server: RunningServer,
                                                                             kind: str | None) -> None:  # fmt: skip
    for stream in (False, True):
        for n in (1, 2):
            body = {"model": "m", "messages": ASK, "max_tokens": 8, "temperature": 0.7, "seed": 1, "n": n,
                    "logprobs": True, "top_logprobs": 20, "logit_bias": {"0": -100, "7": 3.5}, "stream": stream,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                    **CONSTRAINTS.get(kind or "", {})}  # fmt: skip
            if not stream:
                del body["stream_options"]
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as reply:
                text = reply.read().decode()
            assert reply.status_code == 200, text
            payloads = [line[6:] for line in text.splitlines() if line.startswith("data: {")] if stream else [text]

            def refuse(constant: str) -> float:
                raise ValueError(constant)

            assert all(_finite(json.loads(p, parse_constant=refuse)) for p in payloads)
    assert wait_for(lambda: _idle(server), 5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_tools_beside_a_format_answer_with_calls_or_text_in_the_format(server: RunningServer, seed: int) -> None:
    """The Agents SDK sends `tools` (auto) with an `output_type`'s response_format: the format governs the
    text, so the answer is either calls or JSON valid under the schema, never neither."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
    body = {"model": "m", "messages": ASK, "max_tokens": 200, "temperature": 1.0, "seed": seed, "tools": TOOLS,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}  # fmt: skip
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    if choice["finish_reason"] == "length":
        return  # cut: a valid prefix of either, nothing to check whole
    if choice["message"]["tool_calls"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    else:
        assert set(json.loads(choice["message"]["content"])) == {"city"}
