"""An agent harness's loop against the default model (SmolLM2-135M-Instruct), through the official client:
the model is made to call a tool, the harness answers with a `tool` message, the model continues."""

from __future__ import annotations

import json

import jsonschema
import openai

from tests.support.servers import serving, wait_for

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": WEATHER}}
]


def test_agent_loop_with_a_forced_call_on_the_default_model(default_model_dir) -> None:
    with serving(default_model_dir, num_blocks=256, max_num_seqs=2) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=60,
        )  # fmt: skip
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, WEATHER)
        assert "paris" in arguments["city"].lower()  # the model chose the city from the question

        messages.append(choice.message.model_dump())  # as the SDK returns it: content None beside tool_calls
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 18, "sky": "sunny"})})
        second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=40)
        reply = second.choices[0]
        assert reply.finish_reason in ("stop", "length", "tool_calls")
        assert reply.message.content or reply.message.tool_calls
        # The whole first turn was served from the prefix cache on the second.
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
        idle = lambda: server.engine.snapshot()["in_flight"] == 0 == server.engine.snapshot()["blocks_reserved"]  # noqa: E731
        assert wait_for(idle, 5)  # nothing held after the loop
