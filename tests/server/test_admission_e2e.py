"""Admission end to end: DESIGN.md's incident and every admission outcome, through a real server on 127.0.0.1.

Each test starts its own small server (a few ms; the tiny model directory is shared) whose pool is
sized for the scenario, drives it with the official `openai` client, httpx and raw sockets, and
checks what a client sees (status, code, Retry-After, full responses), what an operator sees (the
`admission: ...` log line with its arithmetic, `/v1/admission`, `/metrics`), and that every
reservation returns. Prompts are random token ids (10 per request), so block counts are exact:
`ceil((10 + max_tokens) / 16)`.

Already covered elsewhere and not repeated here: over-`max_model_len` 400s and a 429 with no queue at
all (test_server_errors.py), kv_timeout through the CLI process (test_server_cli.py), and closing raw
sockets while queued and mid-stream (test_server_api.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import RunningServer, make_tiny_model_dir, raw_post, read_until, tiny_engine_config, wait_for

pytestmark = pytest.mark.alone  # measures time: a refusal and an unqueued answer must come back within 0.5 s

PROMPT_LEN = 10
BLOCK = 16
LONG = {"ignore_eos": True}  # the random model may emit EOS early; these runs need their full length


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Run the engines here on one intra-op thread, as their timing-sensitive scenarios need.

    On a shared 2-core machine two OpenMP threads contending with other processes made the tiny model's
    decode step 10-25x slower (3 ms -> 30-85 ms per token, measured); one thread keeps it at ~3 ms.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@contextlib.contextmanager
def _serve(model_dir: Path, **overrides: Any) -> Iterator[RunningServer]:
    running = RunningServer(tiny_engine_config(model_dir, **overrides))
    try:
        yield running
    finally:
        running.stop()


def _client(server: RunningServer, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(20, 400) for _ in range(PROMPT_LEN)]


def _blocks(max_tokens: int) -> int:
    return math.ceil((PROMPT_LEN + max_tokens) / BLOCK)


def _admission(server: RunningServer) -> dict:
    return httpx.get(f"{server.url}/v1/admission", timeout=10).json()


def _metrics(server: RunningServer) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _metric(metrics: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


_GAUGES = {
    "blocks_total": "helexa_kv_blocks_total",
    "blocks_reserved": "helexa_kv_blocks_reserved",
    "blocks_available": "helexa_kv_blocks_available",
    "in_flight": "helexa_requests_in_flight",
    "queue_depth": "helexa_queue_depth",
}


def _assert_consistent(server: RunningServer) -> dict:
    """`/metrics` agrees with `/v1/admission` on the admission state (read between two equal snapshots)."""
    for _ in range(5):  # a request may end between the reads; then read again
        before = _admission(server)
        metrics = _metrics(server)
        after = _admission(server)
        if all(before[key] == after[key] for key in _GAUGES) and before["rejected"] == after["rejected"]:
            break
    else:
        raise AssertionError(f"the admission state never held still for one scrape: {after}")
    for key, name in _GAUGES.items():
        assert _metric(metrics, name) == after[key], (name, after)
    assert _metric(metrics, "helexa_kv_cache_usage_ratio") == pytest.approx(
        after["blocks_reserved"] / after["blocks_total"]
    )
    assert after["blocks_available"] == after["blocks_total"] - after["blocks_reserved"]
    # a sequence never allocates past its reservation: what is not in use covers what is available
    assert after["blocks_empty"] + after["blocks_cached"] >= after["blocks_available"]
    for reason, count in after["rejected"].items():
        assert _metric(metrics, "helexa_admission_rejected_total", reason=reason) == count, reason
    return after


def _released(server: RunningServer) -> dict:
    """Wait (1 s at most) until nothing is reserved, running or queued and no block is in use; the final state."""

    def clean() -> bool:
        s = _admission(server)
        return (s["blocks_reserved"], s["in_flight"], s["queue_depth"], s["blocks_in_use"]) == (0, 0, 0, 0)

    assert wait_for(clean, 1.0), _admission(server)
    server.engine.check_integrity()
    return _admission(server)


def _admission_lines(caplog: pytest.LogCaptureFixture, kind: str) -> list[dict[str, str]]:
    """The `key=value` fields of each `admission: <kind> ...` record, in order (kind: admitted, rejected)."""
    lines = []
    for record in caplog.records:
        message = record.getMessage()
        if record.name == "helexa.admission" and message.startswith(f"admission: {kind} "):
            fields = dict(re.findall(r"(\w+)=(\S+)", message))
            fields["_head"] = message.split()[2]  # "ticket=3" for admitted, the reason for rejected
            lines.append(fields)
    return lines


def _is_ceiling(retry_after: int, logged_wait: str) -> bool:
    """True when `retry_after` is the logged wait estimate (rounded to ms in the log) rounded up, at least 1."""
    wait = float(logged_wait)
    return retry_after >= 1 and retry_after - 1 - 5e-4 < wait <= retry_after + 5e-4


class _Call:
    """`fn()` in a daemon thread; `result()` waits (bounded) and returns its value or re-raises its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self.done_at: float | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:  # handed to the test thread by result()
            self._error = exc
        self.done_at = time.monotonic()

    def result(self, timeout: float = 30) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the call did not finish within {timeout} s"
        if self._error is not None:
            raise self._error
        return self._value


class _Stream:
    """A streamed completion read in a thread: `started` is set at the first chunk (the sequence runs)."""

    def __init__(self, client: openai.OpenAI, prompt: list[int], max_tokens: int) -> None:
        self.started = threading.Event()
        self.chunks: list[Any] = []
        self._stop = threading.Event()
        self._stream: Any = None
        # The server answers a stream's headers with its first token, so even `create` waits for admission.
        self.call = _Call(lambda: self._read(client, prompt, max_tokens))

    def _read(self, client: openai.OpenAI, prompt: list[int], max_tokens: int) -> list[Any]:
        self._stream = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=LONG,
        )
        for chunk in self._stream:
            self.chunks.append(chunk)
            self.started.set()
            if self._stop.is_set():
                break
        return self.chunks

    def close(self) -> None:
        """Leave mid-stream, as a client that gives up does: the connection closes."""
        self._stop.set()
        with contextlib.suppress(Exception):
            self.call.result(10)
        if self._stream is not None:
            self._stream.close()

    def finished(self, timeout: float = 30) -> tuple[str, int]:
        """Wait for the end of the stream: (finish_reason, completion_tokens from the usage chunk)."""
        chunks = self.call.result(timeout)
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        return finish, chunks[-1].usage.completion_tokens


def _post_timed(server: RunningServer, body: dict) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", **body}, timeout=30)
    return response, time.perf_counter() - t0


# --------------------------------------------------------------------------- the incident


def test_incident_third_long_request_waits_instead_of_503(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two long turns fill most of the pool; a third long turn queues, is admitted when one ends, and completes."""
    rng = random.Random(6)
    a_tokens, b_tokens, c_tokens = 310, 470, 470  # 20 + 30 blocks held; the third needs 30 of the 14 left
    with caplog.at_level(logging.INFO, logger="helexa.admission"), _serve(tiny_model_dir, num_blocks=64) as server:
        client = _client(server)
        a = _Stream(client, _prompt(rng), a_tokens)
        b = _Stream(client, _prompt(rng), b_tokens)
        assert a.started.wait(10) and b.started.wait(10)
        snap = _assert_consistent(server)
        held = _blocks(a_tokens) + _blocks(b_tokens)
        assert (snap["in_flight"], snap["queue_depth"], snap["blocks_reserved"]) == (2, 0, held)
        assert snap["blocks_available"] == 64 - held < _blocks(c_tokens)
        assert _metric(_metrics(server), "helexa_kv_cache_usage_ratio") == pytest.approx(held / 64)

        c_prompt = _prompt(rng)
        c = _Call(
            lambda: client.completions.create(model="tiny", prompt=c_prompt, max_tokens=c_tokens, extra_body=LONG)
        )
        assert wait_for(lambda: _admission(server)["queue_depth"] == 1, 5), _admission(server)
        snap = _assert_consistent(server)
        assert snap["in_flight"] == 2 and sum(snap["rejected"].values()) == 0  # it waits: nothing rejected

        third = c.result(60)  # admitted when the first turn ends, then runs to its full length
        assert third.choices[0].finish_reason == "length" and third.usage.completion_tokens == c_tokens
        assert a.finished() == ("length", a_tokens) and b.finished() == ("length", b_tokens)
        assert a.call.done_at <= c.done_at
        final = _released(server)
        assert sum(final["rejected"].values()) == 0
        assert (final["admitted_total"], final["admitted_after_wait"]) == (3, 1)
        metrics = _metrics(server)

    (line,) = _admission_lines(caplog, "admitted")  # one queued admission: the third turn's, with its arithmetic
    assert (line["_head"], line["prompt"], line["max_tokens"]) == ("ticket=3", str(PROMPT_LEN), str(c_tokens))
    assert line["blocks_needed"] == str(_blocks(c_tokens))
    # At its grant the first turn had released its 20 blocks: the second's 30 + the third's 30 are reserved.
    assert (line["blocks_reserved"], line["blocks_available"], line["blocks_total"]) == (
        str(_blocks(b_tokens) + _blocks(c_tokens)),
        str(64 - _blocks(b_tokens) - _blocks(c_tokens)),
        "64",
    )
    assert (line["in_flight"], line["queue_depth"], line["deadline_s"]) == ("2", "0", "600.0")
    assert float(line["waited_s"]) > 0 and float(line["est_wait_s"]) > 0
    assert not _admission_lines(caplog, "rejected")

    # No 503 (nor any rejection) anywhere; the wait histogram saw three admissions, one of them after a wait.
    assert _metric(metrics, "helexa_requests_total", status="200") == 3
    assert _metric(metrics, "helexa_requests_total", status="503") == 0
    for reason in ("queue_full", "kv_timeout", "kv_unservable", "model_reloading"):
        assert _metric(metrics, "helexa_admission_rejected_total", reason=reason) == 0
    assert _metric(metrics, "helexa_admission_wait_seconds_count") == 3
    assert _metric(metrics, "helexa_admission_wait_seconds_bucket", le="0.0") == 2
    assert _metric(metrics, "helexa_admission_wait_seconds_sum") >= float(line["waited_s"]) - 1e-3
    assert _metric(metrics, "helexa_kv_cache_usage_ratio") == 0


# --------------------------------------------------------------------------- immediate rejections


def test_unservable_and_queue_full_answer_at_once(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Never-fits → 400 in milliseconds with no Retry-After and the queue untouched; queue full → 429 + estimate."""
    rng = random.Random(7)
    holder_tokens, queued_tokens = 790, 470  # 50 blocks running, 30 queued (14 available)
    with (
        caplog.at_level(logging.INFO, logger="helexa.admission"),
        _serve(tiny_model_dir, num_blocks=64, max_queue_depth=1) as server,
    ):
        holder = _Stream(_client(server), _prompt(rng), holder_tokens)
        assert holder.started.wait(10)
        queued = raw_post(server.url, "/v1/completions", {"prompt": _prompt(rng), "max_tokens": queued_tokens})
        try:
            assert wait_for(lambda: _admission(server)["queue_depth"] == 1, 5), _admission(server)
            before = _admission(server)

            # Within max_model_len (2048) but larger than the whole pool; a default max_tokens (2048 - 10 = 2038
            # on this node) that makes the request larger than the pool; beyond max_model_len.
            cases = [
                ({"max_tokens": 1100}, ["70 KV blocks", "64 blocks"]),
                ({}, ["max_tokens 2038", "128 KV blocks"]),
                ({"max_tokens": 2100}, ["2110 tokens", "2048"]),
            ]
            seconds = []
            for extra, words in cases:
                response, elapsed = _post_timed(server, {"prompt": _prompt(rng), **extra})
                seconds.append(elapsed)
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["code"] == "context_length_exceeded" and "retry-after" not in response.headers
                assert all(w in error["message"] for w in words), error["message"]
            assert max(seconds) < 0.5, seconds  # milliseconds in practice: nothing waits, nothing is estimated
            after = _admission(server)
            assert (after["queue_depth"], after["in_flight"], after["blocks_reserved"]) == (
                1,
                1,
                before["blocks_reserved"],
            )
            assert after["rejected"]["kv_unservable"] == 3

            # One block would fit now, but FIFO puts it behind the queued request, and the queue is full.
            response, elapsed = _post_timed(server, {"prompt": _prompt(rng), "max_tokens": 6})
            assert response.status_code == 429 and response.json()["error"]["code"] == "queue_full"
            retry_after = int(response.headers["retry-after"])
            assert retry_after >= 1 and elapsed < 0.5
            assert _assert_consistent(server)["queue_depth"] == 1
            metrics = _metrics(server)
        finally:
            queued.close()
            holder.close()
        _released(server)

    assert _metric(metrics, "helexa_admission_rejected_total", reason="kv_unservable") == 3
    assert _metric(metrics, "helexa_admission_rejected_total", reason="queue_full") == 1
    assert _metric(metrics, "helexa_requests_total", status="400") == 3
    assert _metric(metrics, "helexa_requests_total", status="429") == 1
    rejected = _admission_lines(caplog, "rejected")
    assert [r["_head"] for r in rejected] == ["kv_unservable"] * 3 + ["queue_full"]
    assert [r["blocks_needed"] for r in rejected[:2]] == ["70", "128"] and rejected[1]["max_tokens"] == "2038"
    assert all("retry_after_s" not in r for r in rejected[:3])
    assert rejected[3]["retry_after_s"] == str(retry_after) and rejected[3]["queue_depth"] == "1"
    assert _is_ceiling(retry_after, rejected[3]["est_wait_s"])


def test_kv_timeout_at_once_with_the_estimate_as_retry_after(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A wait estimated past --max-wait-secs is a 503 at arrival; Retry-After is the wait for the blocks it needs.

    Two holders run side by side (same measured rate): a short one (20 blocks, 300 tokens) and a long one
    (95 blocks, 1500 tokens), 13 blocks available. A request needing 26 blocks waits only for the short
    holder; one needing 64 blocks waits for the long one: its estimate, and Retry-After, is several times larger.
    """
    rng = random.Random(8)
    short_tokens, long_tokens = 300, 1500
    needs = {"after_short": 400, "after_long": 1000}  # max_tokens: 26 and 64 blocks
    retry_after: dict[str, int] = {}
    with (
        caplog.at_level(logging.INFO, logger="helexa.admission"),
        _serve(tiny_model_dir, num_blocks=128, max_wait_secs=0.2) as server,
    ):
        client = _client(server)
        holders = [_Stream(client, _prompt(rng), short_tokens), _Stream(client, _prompt(rng), long_tokens)]
        try:
            assert all(h.started.wait(10) for h in holders)
            assert _admission(server)["blocks_available"] == 128 - _blocks(short_tokens) - _blocks(long_tokens)
            for name, max_tokens in needs.items():
                response, elapsed = _post_timed(server, {"prompt": _prompt(rng), "max_tokens": max_tokens})
                assert response.status_code == 503, response.text
                error = response.json()["error"]
                assert error["code"] == "kv_timeout" and "beyond the 0.2 s wait limit" in error["message"], error
                assert elapsed < 0.5 and _admission(server)["queue_depth"] == 0  # answered at once, never queued
                retry_after[name] = int(response.headers["retry-after"])
            # What fits now is not held back by the rejections.
            small, _ = _post_timed(server, {"prompt": _prompt(rng), "max_tokens": 4})
            assert small.status_code == 200
            metrics = _metrics(server)
        finally:
            for holder in holders:
                holder.close()
        _released(server)

    assert retry_after["after_long"] > retry_after["after_short"] >= 1, retry_after  # an estimate, not a constant
    lines = _admission_lines(caplog, "rejected")
    assert [r["_head"] for r in lines] == ["kv_timeout", "kv_timeout"]
    for line, (name, max_tokens) in zip(lines, needs.items()):
        assert (line["prompt"], line["max_tokens"]) == (str(PROMPT_LEN), str(max_tokens))
        assert line["blocks_needed"] == str(_blocks(max_tokens)) and line["deadline_s"] == "0.2"
        assert line["blocks_available"] == "13" and float(line["est_wait_s"]) > 0.2
        assert int(line["retry_after_s"]) == retry_after[name] and _is_ceiling(retry_after[name], line["est_wait_s"])
    # ~1500 vs ~300 tokens left at one measured decode rate (which may drift a little between the two requests).
    assert float(lines[1]["est_wait_s"]) > 2 * float(lines[0]["est_wait_s"]), lines
    assert _metric(metrics, "helexa_admission_rejected_total", reason="kv_timeout") == 2
    assert _metric(metrics, "helexa_requests_total", status="503") == 2


# --------------------------------------------------------------------------- FIFO


def test_fifo_large_head_is_not_starved_by_small_requests(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A large request at the head waits for blocks; a steady stream of small ones that fit waits behind it."""
    rng = random.Random(9)
    holder_tokens, large_tokens = 490, 590  # 32 blocks held, 38 needed: the head waits for the holder
    stop = threading.Event()
    small_tokens: list[int] = []  # completion tokens of each small request

    with (
        caplog.at_level(logging.INFO, logger="helexa.admission"),
        _serve(tiny_model_dir, num_blocks=64, max_num_seqs=8) as server,
    ):
        client = _client(server)

        def small_stream(seed: int) -> None:
            local = random.Random(seed)
            while not stop.is_set():
                out = client.completions.create(model="tiny", prompt=_prompt(local), max_tokens=6, extra_body=LONG)
                small_tokens.append(out.usage.completion_tokens)

        holder = _Stream(client, _prompt(rng), holder_tokens)
        assert holder.started.wait(10)
        large = _Stream(client, _prompt(rng), large_tokens)
        assert wait_for(lambda: _admission(server)["queue_depth"] == 1, 5)
        streams = [_Call(lambda s=s: small_stream(s)) for s in range(3)]
        try:
            # While the head waits, small requests that would fit (1 block of 32 available, slots free) wait too.
            assert wait_for(lambda: _admission(server)["queue_depth"] == 4, 5), _admission(server)
            # Until the head is admitted, nothing else may start: while the holder runs (32 blocks) any second
            # sequence that is not the head would leave fewer than the head's 38 blocks reserved.
            samples = 0
            deadline = time.monotonic() + 30
            while not large.started.is_set() and time.monotonic() < deadline:
                snap = _admission(server)
                assert snap["in_flight"] == 1 or snap["blocks_reserved"] >= _blocks(large_tokens), snap
                samples += 1
                time.sleep(0.02)
            assert large.started.wait(1) and samples >= 10, samples
            time.sleep(0.3)  # the stream goes on after the head is admitted
        finally:
            stop.set()
            for call in streams:
                call.result(30)
        assert large.finished() == ("length", large_tokens) and holder.finished() == ("length", holder_tokens)
        _released(server)

    admitted = _admission_lines(caplog, "admitted")
    assert admitted[0]["_head"] == "ticket=2" and admitted[0]["blocks_needed"] == str(_blocks(large_tokens))
    assert all(line["blocks_needed"] == "1" for line in admitted[1:]) and len(admitted) >= 4
    assert all(float(line["waited_s"]) > 0 for line in admitted)
    assert len(small_tokens) >= 4 and set(small_tokens) == {6}


# --------------------------------------------------------------------------- cancellation


def test_cancel_queued_running_and_mid_stream_returns_every_block(tiny_model_dir: Path) -> None:
    """Clients leave at each stage; the queue moves on at once and every reservation comes back."""
    rng = random.Random(10)
    with _serve(tiny_model_dir, num_blocks=64) as server:
        client = _client(server)
        holder = _Stream(client, _prompt(rng), 790)  # 50 blocks for ~790 steps; 14 available
        assert holder.started.wait(10)
        try:
            # Queued: a 30-block head, and a 1-block request behind it that FIFO holds back.
            head = raw_post(server.url, "/v1/completions", {"prompt": _prompt(rng), "max_tokens": 470})
            assert wait_for(lambda: _admission(server)["queue_depth"] == 1, 5)
            behind_prompt = _prompt(rng)
            behind = _Call(
                lambda: client.completions.create(model="tiny", prompt=behind_prompt, max_tokens=5, extra_body=LONG)
            )
            assert wait_for(lambda: _admission(server)["queue_depth"] == 2, 5)
            head.close()  # the head's client leaves while queued: the request behind it is admitted at once
            assert behind.result(10).usage.completion_tokens == 5
            snap = _admission(server)
            assert (snap["queue_depth"], snap["in_flight"], snap["blocks_reserved"]) == (0, 1, _blocks(790))

            # Running, not streaming: the client leaves; the engine aborts it and its 14 blocks return.
            running = raw_post(
                server.url, "/v1/completions", {"prompt": _prompt(rng), "max_tokens": 200, "ignore_eos": True}
            )
            assert wait_for(lambda: _admission(server)["in_flight"] == 2, 5)
            assert _admission(server)["blocks_available"] == 0
            running.close()
            assert wait_for(lambda: _admission(server)["blocks_reserved"] == _blocks(790), 1.0), _admission(server)

            # Streaming, through the official client: close the stream mid-way.
            streamed = client.completions.create(
                model="tiny", prompt=_prompt(rng), max_tokens=200, stream=True, extra_body=LONG
            )
            first = next(iter(streamed))
            assert first.choices and _admission(server)["in_flight"] == 2
            streamed.close()
            assert wait_for(lambda: _admission(server)["in_flight"] == 1, 1.0), _admission(server)
        finally:
            holder.close()  # and the holder leaves mid-stream too
        final = _released(server)
    assert sum(final["rejected"].values()) == 0


def test_raw_stream_disconnect_then_queue_serves_the_next(tiny_model_dir: Path) -> None:
    """A queued request is admitted when a running stream's client disconnects (not only when it finishes)."""
    rng = random.Random(11)
    with _serve(tiny_model_dir, num_blocks=64) as server:
        sock = raw_post(
            server.url,
            "/v1/completions",
            {"prompt": _prompt(rng), "max_tokens": 790, "stream": True, "ignore_eos": True},
        )
        try:
            read_until(sock, b"data: ")
            waiting = _Call(
                lambda: httpx.post(
                    f"{server.url}/v1/completions",
                    timeout=30,
                    json={"prompt": _prompt(rng), "max_tokens": 470, "ignore_eos": True},
                )
            )
            assert wait_for(lambda: _admission(server)["queue_depth"] == 1, 5)
        finally:
            sock.close()
        response = waiting.result(30)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 470
        _released(server)


@pytest.fixture(scope="module")
def long_context_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model with an 8,192-token context: room for the OpenAI-style default of thousands."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("long_context"), max_position_embeddings=8192)


@pytest.mark.parametrize("policy", ["reserve", "adaptive"])
def test_a_burst_of_ordinary_chat_requests_is_served_without_a_single_refusal(
    long_context_model_dir: Path, policy: str
) -> None:
    """The incident's second form: 50 chat requests at once, none with max_tokens (the OpenAI default).

    Each may generate up to 8,000 tokens (502 blocks of 2,008 under `reserve`: four run at a time, 46
    queue). The tiny model's answers end by themselves after ~100 tokens (long-tailed); the node has
    served 24 of them before. Planning with the worst case expects the last of the burst to wait
    twelve rounds of 8,000 tokens — far past the 60 s limit — and refused most of the burst; planning
    with expected answer lengths queues every one, and all are served. Under `adaptive` the same burst
    runs up to 8 at a time on the learned allowance.
    """
    n, warm = 50, 24
    with _serve(
        long_context_model_dir,
        num_blocks=2008,
        max_num_seqs=8,
        default_max_tokens=8000,
        max_wait_secs=60.0,
        policy=policy,
    ) as server:
        client = _client(server, timeout=180)

        def ask(i: int) -> Any:
            messages = [{"role": "user", "content": f"tell me about block {i} of the cache"}]
            return client.chat.completions.create(model="tiny", messages=messages, seed=i)

        for call in [_Call(lambda i=i: ask(i)) for i in range(warm)]:
            call.result(timeout=240)
        assert _admission(server)["answer_length_basis"] == "observed"
        calls = [_Call(lambda i=i: ask(warm + i)) for i in range(n)]
        results = [call.result(timeout=240) for call in calls]  # an exception here is a refusal
        snap = _assert_consistent(server)
        metrics = _metrics(server)
        _released(server)

    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    assert _metric(metrics, "helexa_requests_total", status="200") == warm + n
    assert snap["rejected"] == {"queue_full": 0, "kv_timeout": 0, "kv_unservable": 0, "model_reloading": 0}
    assert snap["answer_length_samples"] == warm + n and snap["policy"] == policy
    lengths = sorted(r.usage.completion_tokens for r in results)
    assert lengths[n // 2] < 800  # ordinary answers: a tenth of the 8,000 each may take
    # what the worst-case planner would have told the last of the burst, at the rate measured here
    worst = math.ceil((n - 4) / 4) * 8000 * snap["decode_step_seconds"]
    assert worst > 60.0, worst


def test_a_burst_past_the_queue_is_refused_at_once_with_the_time_the_queue_needs(tiny_model_dir: Path) -> None:
    """120 requests at once on 8 slots and a 64-deep queue: the ones that do not fit the queue get 429 at once
    with a Retry-After near when the queue really has drained (not "1 s"); none of those queued waits the
    full limit and then fails — a request that would is refused at arrival."""
    # The limit sits well above what the queue takes to drain here (~5-10 s): with 15 s, one queued request's
    # estimate once came out at 14.9 s, so it was queued, and its real wait crossed the limit.
    n, limit = 120, 40.0
    with _serve(tiny_model_dir, num_blocks=128, max_num_seqs=8, max_queue_depth=64, max_wait_secs=limit) as server:
        client = _client(server)
        for i in range(4):  # a warm node: it has measured its steps and seen a few answers
            client.completions.create(model="tiny", prompt=f"warm {i}", max_tokens=100)
        results: list[tuple[int, float, float, str | None]] = []
        lock = threading.Lock()

        def call(i: int) -> None:
            t0 = time.monotonic()
            body = {"model": "tiny", "prompt": f"tell me about block {i}", "max_tokens": 100}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            with lock:
                results.append((response.status_code, t0, time.monotonic(), response.headers.get("retry-after")))

        threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(n)]
        for thread in threads:
            thread.start()
        # Drained: the queue seen non-empty, then empty. (The burst's first answers can come back before
        # the last of its requests has even arrived on a busy machine, while the queue is still filling.)
        drained_at, queued = None, False
        deadline = time.monotonic() + 120
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            if drained_at is None:
                depth = _admission(server)["queue_depth"]
                queued = queued or depth > 0
                if queued and depth == 0:
                    drained_at = time.monotonic()
            time.sleep(0.02)
        assert drained_at is not None
        _released(server)

    statuses = [r[0] for r in results]
    assert len(results) == n and set(statuses) <= {200, 429, 503}, statuses
    assert all(end - start < limit - 1 for status, start, end, _ in results if status == 503)  # never after waiting
    refusals = [(start, int(retry)) for status, start, _, retry in results if status == 429]
    assert len(refusals) >= n - 8 - 64 - 8  # (a few places free up while the burst arrives)
    ratios = sorted(retry / max(0.5, drained_at - start) for start, retry in refusals)
    # The median Retry-After is near when the queue really drained: an estimate from the step times and
    # answer lengths seen so far, rounded up to whole seconds. On two cores it measured 0.3-0.9x in 24 runs of
    # this burst alone (in this process and with the engine core in its own, with and without a CPU hog
    # beside it): the warm node measured its steps one sequence at a time, and a step of eight costs more.
    # Late in full runs, with the step-cost median over the last 64 steps, it measured 0.30x once, 3.0-3.8x,
    # and 4.96x and 7.08x once each; in the 7.08x run the estimate jumped from 1.1 s to 9.6 s between two
    # refusals at the same queue depth, the median having moved to the slow steps of the burst's arrival
    # storm. The median is now over 10 s of work, which such a storm cannot own (`tests/engine/test_stats.py`);
    # whether that was also the 3.0-3.8x is not known, so the top of the band stays wide. The was 1 s
    # against 15 s (0.07x), which the lower bound refuses.
    assert 1 / 4 <= ratios[len(ratios) // 2] <= 9, ratios
