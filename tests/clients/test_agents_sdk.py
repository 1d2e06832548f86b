"""The OpenAI Agents SDK: an agent with one function tool and `tool_choice="required"`, on the chat
completions model and on the Responses model, run and streamed. The loop calls the tool, reads its
result and ends with a final answer (the SDK resets `tool_choice` after a call, as it does against OpenAI)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.clients.conftest import need

pytestmark = pytest.mark.default_model

agents = need("agents", "openai-agents")
openai = need("openai", "openai")

agents.set_tracing_disabled(True)
CALLS: list[str] = []


@agents.function_tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    CALLS.append(city)
    return f"It is sunny and 21 degrees in {city}."


def _agent(base_url: str, api: str) -> Any:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    model_type = agents.OpenAIChatCompletionsModel if api == "chat" else agents.OpenAIResponsesModel
    return agents.Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=model_type(model="m", openai_client=client),
        # temperature 0: the 135M model's answer is then the same every run; max_tokens keeps the suite short
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=80),
    )


async def _streamed(base_url: str, api: str) -> Any:
    result = agents.Runner.run_streamed(_agent(base_url, api), "What is the weather in Paris?", max_turns=4)
    kinds = [event.type async for event in result.stream_events()]
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    return result


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_required_tool_loop_ends_with_a_final_answer(base_url: str, api: str, streamed: bool) -> None:
    CALLS.clear()
    if streamed:
        result = asyncio.run(_streamed(base_url, api))
    else:  # a fresh client per event loop: the SDK's client is bound to the loop it first ran on
        result = agents.Runner.run_sync(_agent(base_url, api), "What is the weather in Paris?", max_turns=4)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds
    assert [city.lower() for city in CALLS] == ["paris"]  # exactly one call, its argument from the question
    assert isinstance(result.final_output, str) and result.final_output.strip()
