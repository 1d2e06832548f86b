"""SPEC.md's error table, row by row: status, `code`, `param`, and whether Retry-After is sent.

Rows produced here: invalid_request (malformed JSON, wrong types, bad values, bad messages),
context_length_exceeded, queue_full, model_reloading (a real reload after a fault injected with
HELEXA_FAULT_INJECT, slowed by the fault backoff, while the one seat is taken and there is no queue),
request_too_large, device_fault (injected faults on consecutive steps past max_fault_retries: the
node gives up). invalid_api_key and kv_timeout run against the CLI server in test_server_cli.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from helexa.model.text.chat_template import ChatTemplate
from tests.support.servers import RunningServer, raw_post, read_until, tiny_engine_config, wait_for

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
    _check(
        _post(server.url, "/v1/completions", {"prompt": long_prompt, "max_tokens": 1}),
        400,
        "context_length_exceeded",
        retry_after=False,
    )
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


def test_queue_full(one_seat_server: RunningServer) -> None:
    url, admission = one_seat_server.url, one_seat_server.engine.admission
    holder = raw_post(
        url, "/v1/completions", {"prompt": "hello", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    )
    try:
        read_until(holder, b"data: ")
        _check(
            _post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
            429,
            "queue_full",
            retry_after=True,
        )
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'helexa_admission_rejected_total{reason="queue_full"} 1.0' in metrics
        assert 'helexa_requests_total{status="429"} 1.0' in metrics
    finally:
        holder.close()
    assert wait_for(lambda: admission.blocks_reserved == 0, 1.0)


@contextlib.contextmanager
def _fault_server(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path, inject: str, **overrides
) -> Iterator[RunningServer]:
    """A fresh one-seat server whose engine faults at the model steps `inject` (HELEXA_FAULT_INJECT).

    The variable is read when the Engine is constructed, so it is set first; steps count from the
    server's first request.
    """
    monkeypatch.setenv("HELEXA_FAULT_INJECT", inject)
    running = RunningServer(tiny_engine_config(model_dir, num_blocks=256, max_num_seqs=1, **overrides))
    try:
        yield running
    finally:
        running.stop()


def _health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


def _sse_errors(data: bytes) -> list[dict]:
    return [
        json.loads(line[6:])["error"]
        for line in data.decode().splitlines()
        if line.startswith("data: {") and '"error"' in line
    ]


def test_model_reloading(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real reload (a fault at step 3, a 2 s backoff before reloading) with the one seat taken and no queue:
    a new request gets 503 model_reloading with Retry-After, /health says reloading; afterwards all serves again."""
    with _fault_server(monkeypatch, tiny_model_dir, "3", max_queue_depth=0, fault_backoff_secs=2.0) as server:
        url, engine = server.url, server.engine
        holder = raw_post(
            url, "/v1/completions", {"prompt": "hello", "max_tokens": 1500, "stream": True, "ignore_eos": True}
        )
        try:
            # Wait on the engine, not on the stream: the tiny model's first tokens may carry no text (held-back
            # UTF-8 bytes), so the first SSE data can arrive only after the reload; step 3 faults regardless.
            assert wait_for(lambda: engine.health.state == "reloading", 10), "the injected fault never started a reload"
            assert _health(url).status_code == 503
            health = _health(url)
            assert health.json()["status"] == "reloading" and "fault_cause" not in health.json()
            _check(
                _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 4}),
                503,
                "model_reloading",
                retry_after=True,
            )
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
            assert 'helexa_model_state{state="reloading"} 1.0' in metrics
            assert 'helexa_admission_rejected_total{reason="model_reloading"} 1.0' in metrics
            assert engine.health.state == "reloading"  # the 2 s backoff had not run out while we asked
            assert wait_for(lambda: _health(url).status_code == 200, 10)
            assert engine.counters.device_faults == 1 and engine.counters.model_reloads == 1
            assert engine.health.last_reload_seconds >= 2.0
            read_until(holder, b"data: {")  # the replayed stream goes on
        finally:
            holder.close()
        assert wait_for(lambda: engine.admission.blocks_reserved == 0, 2.0)
        ok = _post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_device_fault(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Faults at steps 3 and 4 with max_fault_retries=1: the reload's replay faults again and the node gives up.
    In-flight (streaming), queued and new requests all get 500 device_fault carrying the cause; /health says why."""
    with _fault_server(
        monkeypatch, tiny_model_dir, "3,4", max_queue_depth=4, max_fault_retries=1, fault_backoff_secs=2.0
    ) as server:
        url, engine = server.url, server.engine
        holder = raw_post(
            url, "/v1/completions", {"prompt": "hello", "max_tokens": 1500, "stream": True, "ignore_eos": True}
        )
        queued: list[httpx.Response] = []
        try:
            # Wait on the engine, not on the stream (see test_model_reloading).
            assert wait_for(lambda: engine.health.state == "reloading", 10), "the injected fault never started a reload"
            waiter = threading.Thread(
                target=lambda: queued.append(
                    _post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4})
                )
            )
            waiter.start()
            seen: list[dict] = []
            assert wait_for(lambda: seen.append(engine.snapshot()) or seen[-1]["queue_depth"] == 1, 1.5)
            assert seen[-1]["model_state"] == "reloading"  # queued behind the holder while the model reloads
            tail = read_until(holder, b"data: [DONE]")
            waiter.join(timeout=10)
        finally:
            holder.close()
        (stream_error,) = _sse_errors(tail)
        assert stream_error["code"] == "device_fault" and "injected device fault" in stream_error["message"]
        (queued_response,) = queued
        error = _check(queued_response, 500, "device_fault", retry_after=False)
        assert "injected device fault at engine step 4" in error["message"]
        error = _check(
            _post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 5}), 500, "device_fault", retry_after=False
        )
        assert "not recovered after 1 reloads" in error["message"] and "injected device fault" in error["message"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        assert info.value.code == "device_fault"
        health = _health(url)
        assert health.status_code == 503 and health.json()["status"] == "poisoned"
        assert (
            health.json()["fault_cause"] == engine.health.fault_cause
            and "injected device fault" in engine.health.fault_cause
        )
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert "helexa_device_faults_total 2.0" in metrics and "helexa_model_reloads_total 1.0" in metrics
        assert 'helexa_model_state{state="poisoned"} 1.0' in metrics
        assert 'helexa_requests_total{status="500"} 3.0' in metrics
        snap = engine.snapshot()
        assert snap["blocks_reserved"] == 0 and snap["queue_depth"] == 0 and snap["in_flight"] == 0


def test_chat_template_error_is_400(one_seat_server: RunningServer) -> None:
    """A template that refuses the conversation (raise_exception) answers 400 naming `messages`, not 500."""
    templates = one_seat_server.engine.tokenizer.chat_templates
    original = templates["default"]
    templates["default"] = ChatTemplate(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        original.special_tokens,
    )
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


def test_unexpected_exception_is_a_clean_500(one_seat_server: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    engine = one_seat_server.engine
    real_snapshot = engine.snapshot

    def broken_snapshot() -> dict:
        raise KeyError("secret internal detail")

    engine.snapshot = broken_snapshot
    try:
        with caplog.at_level(logging.ERROR, logger="helexa.server"):
            response = httpx.get(f"{one_seat_server.url}/v1/admission", headers={"x-request-id": "req-500"}, timeout=10)
    finally:
        engine.snapshot = real_snapshot
    error = _check(response, 500, "internal_error", retry_after=False)
    assert "req-500" in error["message"] and "secret internal detail" not in response.text
    assert response.headers["x-request-id"] == "req-500"
    assert any("req-500" in r.getMessage() and r.exc_info for r in caplog.records)
