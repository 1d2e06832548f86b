"""The engine core in its own process (`HELEXA_ENGINE_PROCESS=1`): served like the in-process engine, its death
is a device fault (restart, same block count, exact replay, queued requests keep their place, `reloading`,
counted), repeated deaths end poisoned, and no core outlives its server however the server ends."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from helexa.engine import EngineClient
from helexa.engine.core.client import DEFAULT_CORE_NICE, core_nice
from tests.support.servers import RunningServer, metric, tiny_engine_config, wait_for

REPO = Path(__file__).resolve().parents[2]
LONG = {"ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def core_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """One sequence at a time (a second request queues), 128 blocks, half a second of back-off."""
    config = tiny_engine_config(tiny_model_dir, num_blocks=128, max_num_seqs=1, fault_backoff_secs=0.5)
    running = RunningServer(config, in_process=False)
    yield running
    running.stop()


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped by whoever adopted it, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class _Stream:
    """A streaming completion read on a thread: its text pieces and when each came."""

    def __init__(self, client: openai.OpenAI, prompt: str, max_tokens: int) -> None:
        self.pieces: list[tuple[float, str]] = []
        self.finish: str | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(client, prompt, max_tokens), daemon=True)
        self.thread.start()

    def _run(self, client: openai.OpenAI, prompt: str, max_tokens: int) -> None:
        try:
            stream = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True, extra_body=LONG
            )
            for chunk in stream:
                choice = chunk.choices[0]
                if choice.text:
                    self.pieces.append((time.monotonic(), choice.text))
                self.finish = choice.finish_reason or self.finish
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.pieces)


@pytest.mark.alone  # the queued request's first chunk must follow the killed stream's last: a race beside other tests
def test_a_core_sigkill_mid_stream_costs_no_request(core_server: RunningServer) -> None:
    engine = core_server.engine
    assert isinstance(engine, EngineClient)
    client = _client(core_server)
    prompts = ("the first turn of the session", "a second request, queued behind it", "one sent while it restarts")
    lengths = (120, 40, 40)  # the first runs long enough to be killed mid-stream on a loaded machine
    expected = [
        client.completions.create(model="tiny", prompt=p, max_tokens=n, extra_body=LONG).choices[0].text
        for p, n in zip(prompts, lengths)
    ]
    first = _Stream(client, prompts[0], lengths[0])
    assert wait_for(lambda: len(first.pieces) >= 8, 30), "the first stream did not start"
    second = _Stream(client, prompts[1], lengths[1])
    assert wait_for(lambda: engine.snapshot()["queue_depth"] == 1, 30), "the second request did not queue"
    assert len(first.pieces) < lengths[0] - 10
    old_pid = engine.core_pid
    assert old_pid is not None
    os.kill(old_pid, signal.SIGKILL)
    health = f"{core_server.url}/health"
    assert wait_for(lambda: httpx.get(health, timeout=5).json()["status"] == "reloading", 30), "never reloading"
    third = _Stream(client, prompts[2], lengths[2])  # arrives while no core runs: it waits, as it would in the queue
    for stream in (first, second, third):
        stream.thread.join(120)
    assert [s.error for s in (first, second, third)] == [None] * 3
    # Exactly the text a run with no crash gives: nothing sent twice, nothing lost, and each ends as before.
    assert [first.text, second.text, third.text] == expected
    assert first.finish == second.finish == third.finish == "length"
    assert second.pieces[0][0] >= first.pieces[-1][0]  # the queued request kept its place: it ran second
    assert engine.core_pid not in (None, old_pid) and not _alive(old_pid)
    assert httpx.get(f"{core_server.url}/health", timeout=5).status_code == 200
    metrics = httpx.get(f"{core_server.url}/metrics", timeout=10).text
    assert metric(metrics, "helexa_device_faults_total") == 1 and metric(metrics, "helexa_model_reloads_total") == 1
    snap = engine.snapshot()
    assert (snap["blocks_total"], snap["blocks_reserved"], snap["in_flight"]) == (128, 0, 0)  # same pool, none leaked
    engine.check_integrity()


def test_the_core_runs_nicer_than_the_server(core_server: RunningServer) -> None:
    """The core lowers its own priority by `HELEXA_CORE_NICE` (default `DEFAULT_CORE_NICE`) at start, so the
    server's event loop wins a shared CPU; a bad value stops the server before any core starts."""
    engine = core_server.engine
    assert isinstance(engine, EngineClient) and engine.core_pid is not None
    server_nice = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, engine.core_pid) == min(19, server_nice + core_nice())
    assert core_nice("") == DEFAULT_CORE_NICE and core_nice("0") == 0 and core_nice(" 19 ") == 19
    for bad in ("-1", "20", "five", "1.5"):
        with pytest.raises(ValueError, match="HELEXA_CORE_NICE must be an integer from 0 to 19"):
            core_nice(bad)


def test_a_rejection_crosses_the_channel_with_its_status(core_server: RunningServer) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 5000}
    response = httpx.post(f"{core_server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    core_server.engine.check_integrity()


def test_repeated_core_deaths_end_poisoned(tiny_model_dir: Path) -> None:
    config = tiny_engine_config(tiny_model_dir, num_blocks=64, max_fault_retries=1, fault_backoff_secs=0.1)
    server = RunningServer(config, in_process=False)
    try:
        engine = server.engine
        assert isinstance(engine, EngineClient)
        first = engine.core_pid
        os.kill(first, signal.SIGKILL)  # one death: restarted
        assert wait_for(lambda: engine.core_pid not in (None, first) and engine.health.state == "loaded", 60)
        os.kill(engine.core_pid, signal.SIGKILL)  # a second in a row, before it ran a step: the node gives up
        assert wait_for(lambda: engine.health.state == "poisoned", 30)
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 503 and "died: killed by SIGKILL" in health.json()["fault_cause"]
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 500 and response.json()["error"]["code"] == "device_fault"
        assert engine.core_pid is None
    finally:
        server.stop()


def _start_cli_server(model_dir: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """`python -m helexa.server` on `model_dir` with its core in its own process, on a free port: the process
    and its output lines (filled as they come), once it says it serves or has exited."""
    env = {**os.environ, "HELEXA_ENGINE_PROCESS": "1", "TRITON_INTERPRET": "1"}
    argv = ["--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch",
            "--num-blocks", "64", "--port", "0", "--shutdown-grace-secs", "0.5"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "helexa.server", *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(line.rstrip() for line in proc.stdout), daemon=True).start()
    try:
        assert wait_for(lambda: any("helexa: serving" in x for x in lines) or proc.poll() is not None, 90), lines
    except BaseException:
        proc.kill()
        proc.wait(timeout=10)
        raise
    return proc, lines


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_no_core_outlives_its_server(tiny_model_dir: Path, sig: signal.Signals) -> None:
    proc, lines = _start_cli_server(tiny_model_dir)
    try:
        core = int(next(m.group(1) for x in lines if (m := re.search(r"engine core: started \(pid (\d+)\)", x))))
        assert _alive(core)
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0), lines[-20:]
        if sig != signal.SIGKILL:  # the drain shut the core down; the exit's second shutdown has nothing to do
            assert not any("shutdown call failed" in x or "the server is gone" in x for x in lines), lines[-20:]
        assert wait_for(lambda: not _alive(core), 15), f"core {core} outlived its server after {sig.name}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.parametrize("answered", [True, False])
def test_the_channel_s_end_is_news_only_before_shutdown_is_answered(
    answered: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The server closes the channel once the core has answered `shutdown`, while the core is still exiting:
    that end of stream is expected (no warning). Before the answer it means the server is gone: a
    warning. Either way the core goes on to exit."""
    from unittest import mock

    from helexa.engine.core import process

    exits: list[object] = []
    ours, theirs = socket.socketpair()
    core = process.CoreServer(mock.MagicMock(), ours, on_channel_end=exits.append)
    try:
        core._replied_shutdown = answered
        theirs.close()
        with caplog.at_level("DEBUG", logger=process.logger.name):
            core._read()  # the end of stream, on this thread
    finally:
        core._loop.close()
        ours.close()
    assert exits == [core.engine]
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "the server is gone" in r.getMessage()]
    assert len(warned) == (0 if answered else 1)


def test_the_server_s_side_of_a_core_never_loads_torch(tiny_model_dir: Path) -> None:
    """With the core in its own process, the server process keeps HTTP, templates, tokenising, grammars and
    streaming, and none of that needs torch: it is never loaded there, whatever the server is asked (the
    import alone is ~200 MiB of resident memory, a second copy of the core's). Every route family is asked."""
    proc, lines = _start_cli_server(tiny_model_dir)
    try:
        port = next(int(m.group(1)) for x in lines if (m := re.search(r"http://127\.0\.0\.1:(\d+)", x)))
        url = f"http://127.0.0.1:{port}"
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        posts = [
            ("/v1/chat/completions", chat),
            ("/v1/chat/completions", {**chat, "stream": True, "logprobs": True, "top_logprobs": 2}),
            (
                "/v1/chat/completions",
                {
                    **chat,
                    "max_tokens": 16,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
                },
            ),  # fmt: skip
            ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 3, "logprobs": 2, "n": 2}),
            ("/v1/responses", {"model": "tiny", "input": "hello", "max_output_tokens": 3}),
            ("/v1/chat/completions/render", chat),
            ("/tokenize", {"model": "tiny", "prompt": "hello"}),
            ("/detokenize", {"model": "tiny", "tokens": [5, 6, 7]}),
            ("/flush_cache", {}),
        ]
        for path, body in posts:
            response = httpx.post(url + path, json=body, timeout=60)
            assert response.status_code == 200, (path, response.text)
        gets = ["/health", "/metrics", "/v1/admission", "/v1/models", "/v1/dashboard", "/", "/get_load",
                "/v1/capacity", "/server_info", "/get_model_info"]  # fmt: skip
        for path in gets:
            response = httpx.get(url + path, timeout=30)
            assert response.status_code == 200, (path, response.text)
        with open(f"/proc/{proc.pid}/maps") as maps:
            torch_libraries = sorted({line.split()[-1] for line in maps if "libtorch" in line})
        assert torch_libraries == [], torch_libraries
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_the_server_s_loop_is_woken_once_a_frame(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The core sends a step's events in one frame; the server's side puts them into their streams and wakes
    the event loop consuming them once for the frame, not once per event, and every token arrives. A request
    that queued learns when it was granted from its first event."""
    from helexa.engine.core import client as core_client
    from helexa.model.sampling import SamplingParams
    from tests.support.loops import CountingLoop

    frames: list[int] = []  # the number of events in each events frame read
    read = core_client.read_frame

    def counted(sock: socket.socket):
        frame = read(sock)
        if frame[0] == "events":
            frames.append(len(frame[1]))
        return frame

    monkeypatch.setattr(core_client, "read_frame", counted)
    engine = EngineClient(tiny_engine_config(tiny_model_dir, num_blocks=128, max_num_seqs=4))
    counting = CountingLoop()
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        handles = [engine.submit([5, 6, 7, 8 + i], params) for i in range(5)]  # the fifth waits for a row
        queued = handles[4].ticket
        assert queued.granted_at is None
        got: dict[str, list[int]] = {h.request_id: [] for h in handles}

        async def consume(handle) -> None:
            async for event in handle.stream:
                got[handle.request_id].extend(event.token_ids)

        futures = [asyncio.run_coroutine_threadsafe(consume(h), counting.loop) for h in handles]
        counting.calls = 0  # those four calls started the consumers
        for future in futures:
            future.result(120)
        assert all(len(ids) == 12 for ids in got.values())
        assert queued.granted_at is not None and queued.granted_at > handles[0].ticket.granted_at
        assert sum(frames) >= 5 * 12 > len(frames)  # frames carry several events each
        assert counting.calls <= len(frames)  # at most one wake-up a frame (a stream bound late is not owed one)
    finally:
        counting.close()
        engine.shutdown()
