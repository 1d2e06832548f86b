"""SPEC.md's error table, row by row: status, `code`, `param`, and whether Retry-After is sent.

Rows produced here: invalid_request (malformed JSON, wrong types, bad values, bad messages),
context_length_exceeded, queue_full, model_reloading (admission's real path, with the model state set by
the test until the reliability issue drives it), request_too_large, device_fault (a step that raises, the
engine's device-fault path). invalid_api_key and kv_timeout run against the CLI server in
test_server_cli.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from helexa.model.chat_template import ChatTemplate
from tests.server.helpers import RunningServer, raw_post, read_until, tiny_engine_config, wait_for

MESSAGES = [{"role": "user", "content": "hello"}]


def _post(url: str, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    return httpx.post(url + path, json=body, timeout=30)


def _check(response: httpx.Response, status: int, code: str, *, retry_after: bool, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["message"]
    assert error["code"] == code and error["param"] == param
    assert ("retry-after" in response.headers) == retry_after
    if retry_after:
        assert int(response.headers["retry-after"]) >= 1
    assert "Traceback" not in response.text and "x-request-id" in response.headers
    return error


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
@pytest.mark.parametrize("raw", [b"{not json", b"[]", b"\xff"])
def test_malformed_json(server: RunningServer, path: str, raw: bytes) -> None:
    _check(_post(server.url, path, raw), 400, "invalid_request", retry_after=False)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 1.5}, "top_p"),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 500}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": [1, 2, 10**6]}, "prompt"),  # a token id outside the vocabulary
        ("/v1/completions", {"prompt": {"text": "x"}}, "prompt"),
        ("/v1/responses", {"input": "x", "max_output_tokens": -3}, "max_output_tokens"),
        ("/v1/responses", {"input": [{"type": "function_call_output"}]}, "input[0]"),
    ],
)  # fmt: skip
def test_bad_parameters(server: RunningServer, path: str, body: dict, param: str) -> None:
    _check(_post(server.url, path, {"model": "tiny", **body}), 400, "invalid_request", retry_after=False, param=param)


def test_openai_client_sees_the_param(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=5)
    assert info.value.status_code == 400 and info.value.code == "invalid_request" and info.value.param == "temperature"


def test_context_length_exceeded(server: RunningServer, client: openai.OpenAI) -> None:
    # max_model_len is 2048: prompt + max_tokens over it can never fit this node, so no Retry-After.
    response = _post(server.url, "/v1/completions", {"prompt": "hello", "max_tokens": 2100})
    error = _check(response, 400, "context_length_exceeded", retry_after=False)
    assert "2048" in error["message"]
    long_prompt = list(range(5, 300)) * 7  # 2065 token ids
    _check(_post(server.url, "/v1/completions", {"prompt": long_prompt, "max_tokens": 1}), 400,
           "context_length_exceeded", retry_after=False)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5000)
    assert info.value.code == "context_length_exceeded"


def test_request_too_large(server: RunningServer) -> None:
    body = b'{"prompt": "' + b"a" * (9 << 20) + b'", "max_tokens": 1}'  # 9 MiB, over the 8 MiB default
    _check(_post(server.url, "/v1/completions", body), 413, "request_too_large", retry_after=False)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # the server is fine


def test_not_found_and_method_not_allowed(server: RunningServer) -> None:
    _check(httpx.get(f"{server.url}/v1/nothing", timeout=10), 404, "not_found", retry_after=False)
    _check(httpx.get(f"{server.url}/v1/chat/completions", timeout=10), 405, "method_not_allowed", retry_after=False)


@pytest.fixture(scope="module")
def one_seat_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """One sequence at a time and no admission queue: a second request finds the queue full."""
    running = RunningServer(tiny_engine_config(tiny_model_dir, num_blocks=256, max_num_seqs=1, max_queue_depth=0))
    yield running
    running.stop()


def test_queue_full_and_model_reloading(one_seat_server: RunningServer) -> None:
    url, admission = one_seat_server.url, one_seat_server.engine.admission
    holder = raw_post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 1500, "stream": True,
                                               "ignore_eos": True})
    try:
        read_until(holder, b"data: ")
        _check(_post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}), 429, "queue_full",
               retry_after=True)
        admission.set_model_state("reloading")  # what the engine does after a device fault (reliability issue)
        try:
            _check(_post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 4}), 503, "model_reloading",
                   retry_after=True)
            health = httpx.get(f"{url}/health", timeout=10)
            assert health.status_code == 503 and health.json()["status"] == "reloading"
            assert 'helexa_model_state{state="reloading"} 1.0' in httpx.get(f"{url}/metrics", timeout=10).text
        finally:
            admission.set_model_state("loaded")
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'helexa_admission_rejected_total{reason="queue_full"} 1.0' in metrics
        assert 'helexa_admission_rejected_total{reason="model_reloading"} 1.0' in metrics
        assert 'helexa_requests_total{status="429"} 1.0' in metrics
    finally:
        holder.close()
    assert wait_for(lambda: admission.blocks_reserved == 0, 1.0)


def test_device_fault(one_seat_server: RunningServer) -> None:
    """A step that raises goes through the engine's device-fault path: 500 device_fault carrying the cause."""
    runner = one_seat_server.engine.runner
    real_execute = runner.execute
    calls = []

    def failing_execute(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        return real_execute(*args, **kwargs)

    runner.execute = failing_execute
    try:
        response = _post(one_seat_server.url, "/v1/completions", {"prompt": "hello", "max_tokens": 5})
    finally:
        runner.execute = real_execute
    error = _check(response, 500, "device_fault", retry_after=False)
    assert "illegal memory access" in error["message"]
    ok = _post(one_seat_server.url, "/v1/completions", {"prompt": "hello", "max_tokens": 5})
    assert ok.status_code == 200
    assert one_seat_server.engine.admission.blocks_reserved == 0


def test_chat_template_error_is_400(one_seat_server: RunningServer) -> None:
    """A template that refuses the conversation (raise_exception) answers 400 naming `messages`, not 500."""
    templates = one_seat_server.engine.tokenizer.chat_templates
    original = templates["default"]
    templates["default"] = ChatTemplate(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}", original.special_tokens)
    try:
        response = _post(one_seat_server.url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
        error = _check(response, 400, "invalid_request", retry_after=False, param="messages")
        assert "a system message must come first" in error["message"]
        response = _post(one_seat_server.url, "/v1/responses", {"input": "hi", "max_output_tokens": 2})
        _check(response, 400, "invalid_request", retry_after=False, param="input")
        ok = _post(one_seat_server.url, "/v1/responses", {"input": "hi", "instructions": "x", "max_output_tokens": 2})
        assert ok.status_code == 200
    finally:
        templates["default"] = original


def test_unexpected_exception_is_a_clean_500(one_seat_server: RunningServer,
                                             caplog: pytest.LogCaptureFixture) -> None:
    engine = one_seat_server.engine
    real_snapshot = engine.snapshot

    def broken_snapshot() -> dict:
        raise KeyError("secret internal detail")

    engine.snapshot = broken_snapshot
    try:
        with caplog.at_level(logging.ERROR, logger="helexa.server"):
            response = httpx.get(f"{one_seat_server.url}/v1/admission", headers={"x-request-id": "req-500"},
                                 timeout=10)
    finally:
        engine.snapshot = real_snapshot
    error = _check(response, 500, "internal_error", retry_after=False)
    assert "req-500" in error["message"] and "secret internal detail" not in response.text
    assert response.headers["x-request-id"] == "req-500"
    assert any("req-500" in r.getMessage() and r.exc_info for r in caplog.records)
