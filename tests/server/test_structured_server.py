"""Structured output through the HTTP API with the official client: answers validate; bad requests are 400."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.support.servers import RunningServer

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "sunny": {"type": "boolean"},
                   "level": {"enum": ["low", "mid", "high"]}},
    "required": ["city", "sunny", "level"],
    "additionalProperties": False,
}  # fmt: skip


def test_chat_json_schema_and_json_object(server: RunningServer, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Weather?"}]
    reply = client.chat.completions.create(
        model="m", messages=messages, max_tokens=120, temperature=0.7, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(
        model="m", messages=messages, max_tokens=120, temperature=0.0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    obj = client.chat.completions.create(
        model="m", messages=messages, max_tokens=60, temperature=0.0, response_format={"type": "json_object"}
    )
    if obj.choices[0].finish_reason == "stop":  # an open object can run to max_tokens on a random model
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")


def test_responses_text_format(server: RunningServer, client: openai.OpenAI) -> None:
    resp = client.responses.create(
        model="m", input="Weather?", max_output_tokens=120,
        text={"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)


@pytest.mark.parametrize(
    "path, extra, param",
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}},
            "response_format",
        ),  # noqa: E501
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/responses", {"text": {"format": {"type": "json_schema", "schema": {"type": 5}}}}, "text.format"),
    ],
)
def test_invalid_formats_are_400(server: RunningServer, path: str, extra: dict, param: str) -> None:
    body = {"model": "m", "max_tokens": 4, **extra}
    body.update({"input": "hi"} if path == "/v1/responses" else {"messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenize_and_detokenize(server: RunningServer) -> None:
    tok = server.engine.tokenizer
    r = httpx.post(f"{server.url}/tokenize", json={"model": "m", "prompt": "hello world"}, timeout=30).json()
    assert r["tokens"] == tok.encode("hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == server.engine.max_model_len
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30).json()
    assert chat["tokens"] == tok.apply_chat_template(messages, add_generation_prompt=True)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert back == {"prompt": tok.decode(r["tokens"])}
    for path, body, param in [
        ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ]:
        bad = httpx.post(f"{server.url}{path}", json=body, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
