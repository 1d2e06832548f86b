"""The openai client: `logprobs` + `top_logprobs` under every kind of constrained output (they are the
model's own distribution, finite, in strict JSON, streamed or not), model retrieve, and the Responses
stream helper (its terminal events as OpenAI sends them)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tests.clients.conftest import need

pytestmark = pytest.mark.default_model

openai = need("openai", "openai")

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]  # fmt: skip
# Each constraint, and the unconstrained request whose prompt is the same (so its first step's
# distribution is the one the constrained request's logprobs must show).
CONSTRAINTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}}, {}),
    "json_object": ({"response_format": {"type": "json_object"}}, {}),
    "tool_choice required": ({"tools": TOOLS, "tool_choice": "required"}, {"tools": TOOLS, "tool_choice": "auto"}),
    "tool_choice named": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"tools": TOOLS, "tool_choice": "auto"},
    ),
}


def _client(base_url: str) -> Any:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_logprobs_under_every_constraint(base_url: str, kind: str) -> None:
    constrained, same_prompt = CONSTRAINTS[kind]
    client = _client(base_url)
    common = dict(model="m", messages=ASK, max_tokens=24, temperature=0, logprobs=True, top_logprobs=5)
    reply = client.chat.completions.create(**common, **constrained)
    entries = reply.choices[0].logprobs.content
    assert entries and all(math.isfinite(e.logprob) and e.logprob <= 0 for e in entries)
    assert all(len(e.top_logprobs) == 5 and all(math.isfinite(t.logprob) for t in e.top_logprobs) for e in entries)
    # The grammar leaves one choice for many of these tokens; their logprobs are still the model's (< 0),
    # never the 0.0 of a masked distribution.
    assert any(e.logprob < -1e-3 for e in entries)
    # The first step's alternatives are exactly those of the same prompt without the constraint.
    free = client.chat.completions.create(**{**common, "max_tokens": 1}, **same_prompt).choices[0].logprobs.content[0]
    first = entries[0]
    assert [t.token for t in first.top_logprobs] == [t.token for t in free.top_logprobs]
    assert [t.logprob for t in first.top_logprobs] == pytest.approx([t.logprob for t in free.top_logprobs], abs=1e-4)

    stream = client.chat.completions.create(**common, **constrained, stream=True)
    streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-6)


def test_streamed_logprob_chunks_are_strict_json(base_url: str) -> None:
    """Read the raw stream: every `data:` line parses with a JSON parser that refuses NaN and Infinity."""
    constrained, _ = CONSTRAINTS["tool_choice named"]
    client = _client(base_url)
    with client.chat.completions.with_streaming_response.create(
        model="m", messages=ASK, max_tokens=24, temperature=0, logprobs=True, top_logprobs=20, stream=True,
        **constrained,
    ) as response:  # fmt: skip
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]

    def refuse(constant: str) -> float:
        raise ValueError(f"non-finite number {constant} on the wire")

    assert lines and all(json.loads(line, parse_constant=refuse) for line in lines)


def test_models_retrieve(base_url: str, served: Any) -> None:
    client = _client(base_url)
    model = client.models.retrieve(served.engine.model_name)
    assert model.id == served.engine.model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_responses_stream_ends_as_openai_ends_it(base_url: str) -> None:
    """Cut at `max_output_tokens`: the terminal event is `response.incomplete` (the SDK parses it); an answer
    that ends by itself is `response.completed`, which the SDK's `get_final_response()` needs."""
    client = _client(base_url)
    with client.responses.stream(model="m", input="Tell me a long story.", max_output_tokens=8) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    with client.responses.stream(
        model="m", input="Say hello.", max_output_tokens=64, temperature=0,
        text={"format": {"type": "json_schema", "name": "greeting", "strict": True,
                         "schema": {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 20}},
                                    "required": ["greeting"]}}},
    ) as stream:  # fmt: skip
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == "completed" and set(json.loads(final.output_text)) == {"greeting"}
    assert final.text.format.type == "json_schema"  # the format the server enforced, echoed
