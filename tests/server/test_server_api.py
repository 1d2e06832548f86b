"""The routes, driven by the official `openai` client (and httpx) against a real server on 127.0.0.1."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helexa.server.metrics import METRIC_NAMES
from tests.support.servers import RunningServer, raw_post, read_until, wait_for

MESSAGES = [{"role": "system", "content": "you are a café model"}, {"role": "user", "content": "hello world 你好"}]
LONG = {"ignore_eos": True}  # the random model may emit EOS early; these runs need their full length


def _admission(server: RunningServer) -> dict:
    return httpx.get(f"{server.url}/v1/admission", timeout=10).json()


def test_models_health_admission(server: RunningServer, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [server.engine.model_name]
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    snap = _admission(server)
    for key in (
        "block_size",
        "blocks_total",
        "blocks_free",
        "blocks_reserved",
        "blocks_available",
        "blocks_cached",
        "blocks_empty",
        "blocks_in_use",
        "blocks_retained",
        "in_flight",
        "max_in_flight",
        "queue_depth",
        "max_queue_depth",
        "rejected",
        "model_state",
    ):
        assert key in snap, key
    assert set(snap["rejected"]) >= {"queue_full", "kv_timeout", "kv_unservable"}
    assert snap["blocks_empty"] + snap["blocks_cached"] + snap["blocks_in_use"] == snap["blocks_total"]
    assert (snap["blocks_total"], snap["block_size"], snap["model_state"]) == (256, 16, "loaded")


def test_chat_non_streaming_usage_and_greedy_repeat(server: RunningServer, client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, extra_body=LONG
    )
    (choice,) = first.choices
    assert first.object == "chat.completion" and first.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason == "length" and choice.message.content
    prompt_len = len(server.engine.tokenizer.apply_chat_template(MESSAGES))
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.total_tokens) == (
        prompt_len,
        12,
        prompt_len + 12,
    )
    again = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, extra_body=LONG
    )
    assert again.choices[0].message.content == choice.message.content


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=15, temperature=0, extra_body=LONG)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(**kwargs, stream=True))  # no include_usage: no usage chunk
    assert all(c.choices for c in plain)


def test_completions_stream_echo_and_prompt_forms(server: RunningServer, client: openai.OpenAI) -> None:
    whole = client.completions.create(
        model="tiny", prompt="the quick brown fox", max_tokens=10, temperature=0, extra_body=LONG
    )
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    ids = server.engine.tokenizer.encode("the quick brown fox")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 10)
    as_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0, extra_body=LONG)
    assert as_ids.choices[0].text == whole.choices[0].text
    stream = list(
        client.completions.create(
            model="tiny",
            prompt="the quick brown fox",
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=LONG,
        )
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text
    assert stream[-1].usage.completion_tokens == 10
    echo = client.completions.create(
        model="tiny", prompt="the quick brown fox", max_tokens=10, temperature=0, echo=True, extra_body=LONG
    )
    assert echo.choices[0].text == "the quick brown fox" + whole.choices[0].text
    batch = client.completions.create(
        model="tiny", prompt=["the quick brown fox", "hello"], max_tokens=4, n=2, temperature=0, extra_body=LONG
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == whole.choices[0].text[: len(batch.choices[0].text)]
    assert batch.usage.prompt_tokens == len(ids) + len(server.engine.tokenizer.encode("hello"))
    assert batch.usage.completion_tokens == 16


def test_stop_strings(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt="hello world", max_tokens=40, temperature=0, extra_body=LONG)
    full = client.completions.create(**kwargs).choices[0].text
    # A stop string taken from the middle of the greedy output, at its first occurrence.
    cut = next(
        i for i in range(3, len(full) - 2) if full.find(full[i : i + 2]) == i and "\ufffd" not in full[i : i + 2]
    )
    stop = full[cut : cut + 2]
    stopped = client.completions.create(**kwargs, stop=[stop, "never-in-output"])
    assert stopped.choices[0].text == full[:cut] and stopped.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**kwargs, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == full[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility_and_n(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=24, temperature=1.0, extra_body=LONG)
    a = client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    b = client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    c = client.chat.completions.create(**kwargs, seed=4321).choices[0].message.content
    assert a == b and a != c
    three = client.chat.completions.create(**kwargs, seed=1234, n=3)
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    assert three.choices[0].message.content == a  # choice i samples with seed + i
    assert len({ch.message.content for ch in three.choices}) == 3
    assert three.usage.completion_tokens == 72
    streamed = list(client.chat.completions.create(**kwargs, seed=1234, n=3, stream=True))
    for i in range(3):
        text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices and ch.choices[0].index == i)
        assert text == three.choices[i].message.content


def test_chat_logprobs(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, extra_body=LONG
    )
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens == 8
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert math.isclose(entry.logprob, tops[0], abs_tol=1e-5)  # greedy picks the most likely token
        assert sum(math.exp(t) for t in tops) <= 1 + 1e-4
    plain = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, extra_body=LONG
    )
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == result.choices[0].message.content
    streamed = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            extra_body=LONG,
        )
    )
    lp = [e.logprob for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert lp == pytest.approx([e.logprob for e in content], abs=1e-6)


def test_completion_logprobs(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=6, temperature=0.8, seed=7, logprobs=2, extra_body=LONG
    )
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    only = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=6, temperature=0.8, seed=7, logprobs=0, extra_body=LONG
    )
    assert only.choices[0].logprobs.top_logprobs is None
    assert only.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_responses(server: RunningServer, client: openai.OpenAI) -> None:
    result = client.responses.create(model="tiny", input="hello world", max_output_tokens=10, temperature=0)
    assert result.object == "response" and result.output_text
    assert result.status in ("completed", "incomplete")
    assert (result.status == "incomplete") == (result.incomplete_details is not None)
    prompt_len = len(server.engine.tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}]))
    assert result.usage.input_tokens == prompt_len and 1 <= result.usage.output_tokens <= 10
    if result.status == "incomplete":
        assert result.usage.output_tokens == 10
    with_instructions = client.responses.create(
        model="tiny", input="hello world", instructions="be brief", max_output_tokens=4, temperature=0
    )
    assert with_instructions.usage.input_tokens > prompt_len

    events = list(
        client.responses.create(model="tiny", input="hello world", max_output_tokens=10, temperature=0, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{result.status}",  # as OpenAI's: response.incomplete when cut at max_output_tokens
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == events[-1].response.output_text == result.output_text
    assert events[-1].response.usage.output_tokens == result.usage.output_tokens
    assert events[-1].response.status == result.status

    with client.responses.stream(  # the SDK's stream helper reads every event, the terminal one included
        model="tiny", input=[{"role": "user", "content": "hello world"}], max_output_tokens=10, temperature=0
    ) as stream:
        helper_events = list(stream)
    assert helper_events[-1].type == f"response.{result.status}"
    assert helper_events[-1].response.output_text == result.output_text


def test_unknown_fields_ignored_and_request_ids(server: RunningServer) -> None:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 3,
        "a_future_option": {"x": [1, 2]},
        "metadata": {"k": "v"},
        "user": "someone",
        "parallel_tool_calls": False,
    }
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200 and len(response.json()["choices"]) == 1
    assert len(response.headers["x-request-id"]) == 32
    given = httpx.get(f"{server.url}/health", headers={"x-request-id": "trace-42"}, timeout=10)
    assert given.headers["x-request-id"] == "trace-42"
    bad = httpx.get(f"{server.url}/health", headers={"x-request-id": "bad id\twith spaces"}, timeout=10)
    assert bad.headers["x-request-id"] != "bad id\twith spaces"
    missing = httpx.get(f"{server.url}/nope", timeout=10)
    assert missing.status_code == 404 and "x-request-id" in missing.headers
    assert missing.json()["error"]["code"] == "not_found"


def test_disconnects_release_every_block(server: RunningServer) -> None:
    """Two streams reserve most of the pool, a third waits for blocks; clients leave; everything returns."""
    long_body = {"model": "tiny", "prompt": "hello", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    holders = [raw_post(server.url, "/v1/completions", long_body) for _ in range(2)]
    try:
        for sock in holders:
            read_until(sock, b"data: ")  # streaming: both are running
        snap = _admission(server)
        assert snap["in_flight"] == 2 and snap["blocks_available"] < 8
        waiting = raw_post(server.url, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 100})
        assert wait_for(lambda: _admission(server)["queue_depth"] == 1, 5)
        waiting.close()  # leaves before admission
        assert wait_for(lambda: _admission(server)["queue_depth"] == 0, 1.0)
        assert _admission(server)["in_flight"] == 2
    finally:
        for sock in holders:
            sock.close()  # leave mid-stream
    assert wait_for(lambda: _admission(server)["blocks_reserved"] == 0, 1.0), _admission(server)
    snap = _admission(server)
    assert snap["in_flight"] == 0 and snap["blocks_in_use"] == 0


def test_metrics_parse_and_cover_spec(server: RunningServer, client: openai.OpenAI) -> None:
    client.completions.create(model="tiny", prompt="hello", max_tokens=3)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {s.name: s for f in families.values() for s in f.samples}
    for name in METRIC_NAMES:
        assert name in families or name in samples or name.removesuffix("_total") in families, name

    def value(name: str, **labels: str) -> float:
        return next(s.value for f in families.values() for s in f.samples if s.name == name and s.labels == labels)

    assert value("helexa_kv_blocks_total") == 256
    assert value("helexa_requests_total", status="200") >= 1
    assert value("helexa_generation_tokens_total") >= 3 and value("helexa_prompt_tokens_total") >= 1
    assert value("helexa_model_state", state="loaded") == 1 and value("helexa_model_state", state="poisoned") == 0
    assert value("helexa_time_to_first_token_seconds_count") >= 1
    assert value("helexa_request_duration_seconds_count") >= 1
    assert value("helexa_admission_wait_seconds_count") >= 1
    assert 0 <= value("helexa_kv_cache_usage_ratio") <= 1
    for reason in ("queue_full", "kv_timeout", "kv_unservable", "model_reloading"):
        assert value("helexa_admission_rejected_total", reason=reason) >= 0
