"""instructor: a small pydantic model extracted in its default mode (`Mode.TOOLS`: a forced tool call), in
`Mode.JSON_SCHEMA` (response_format) and in `Mode.RESPONSES_TOOLS` (the Responses API: a forced call beside
`text.format`). `max_retries=0`, so a malformed answer fails the test instead of being retried."""

from __future__ import annotations

import pytest

from tests.clients.conftest import need

pytestmark = pytest.mark.default_model

instructor = need("instructor", "instructor")
openai = need("openai", "openai")
pydantic = need("pydantic", "pydantic")


class Weather(pydantic.BaseModel):
    city: str
    temperature: int


PROMPT = [{"role": "user", "content": "It is 21 degrees in Paris. Extract the weather."}]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_chat_modes_extract_the_model(base_url: str, mode: str, seed: int) -> None:
    client = instructor.from_openai(
        openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120), mode=instructor.Mode[mode]
    )
    weather = client.chat.completions.create(
        model="m", response_model=Weather, messages=PROMPT, max_retries=0, max_tokens=96, seed=seed
    )
    assert isinstance(weather, Weather) and weather.city == "Paris"


def test_responses_tools_extracts_the_model(base_url: str) -> None:
    client = instructor.from_openai(
        openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120),
        mode=instructor.Mode.RESPONSES_TOOLS,
    )
    weather = client.create(model="m", response_model=Weather, messages=PROMPT, max_retries=0, max_output_tokens=96)
    assert isinstance(weather, Weather) and weather.city == "Paris"
