"""langchain-openai's `ChatOpenAI`, on chat completions and with `use_responses_api=True`: `bind_tools` with
`tool_choice="any"` and with the tool's name (one call, arguments valid, no invented keys: LangChain's
`@tool` schemas never close their objects), and `with_structured_output` by `json_schema` and by
`function_calling`."""

from __future__ import annotations

from typing import Any

import pytest

from tests.clients.conftest import need

pytestmark = pytest.mark.default_model

langchain_openai = need("langchain_openai", "langchain-openai")
tools = need("langchain_core.tools", "langchain-core")
pydantic = need("pydantic", "pydantic")


@tools.tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"sunny in {city}"


class Weather(pydantic.BaseModel):
    """The weather in a city."""

    city: str
    temperature: int


def _llm(base_url: str, responses: bool) -> Any:
    return langchain_openai.ChatOpenAI(
        model="m", base_url=base_url, api_key="unused", max_retries=0, timeout=120, max_tokens=80, temperature=0,
        use_responses_api=responses,
    )  # fmt: skip


API = pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])


@API
@pytest.mark.parametrize("choice", ["any", "get_weather"])
def test_bind_tools_forces_one_clean_call(base_url: str, responses: bool, choice: str) -> None:
    message = (
        _llm(base_url, responses).bind_tools([get_weather], tool_choice=choice).invoke("What is the weather in Paris?")
    )
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}
    assert not message.invalid_tool_calls


@API
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(base_url: str, responses: bool, method: str) -> None:
    structured = _llm(base_url, responses).with_structured_output(Weather, method=method)
    weather = structured.invoke("It is 21 degrees in Paris. Extract the weather.")
    assert isinstance(weather, Weather) and weather.city == "Paris"
