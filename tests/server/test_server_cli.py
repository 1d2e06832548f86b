"""`python -m helexa.server` as a real process: flags, start-up line, API key, kv_timeout, SIGTERM drain."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helexa.server.cli import build_parser, configs_from_args
from helexa.server.settings import ServerSettings, is_loopback
from tests.support.servers import raw_post, read_until, wait_for

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-test-0123456789"


def test_flags_map_to_engine_config() -> None:
    args = build_parser().parse_args(
        [
            "--model",
            "/m",
            "--device",
            "cpu",
            "--dtype",
            "bfloat16",
            "--block-size",
            "32",
            "--kv-cache-memory",
            "512MiB",
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            "3",
            "--max-queue-depth",
            "7",
            "--max-wait-secs",
            "2.5",
            "--attention-backend",
            "torch",
            "--host",
            "::1",
            "--port",
            "0",
            "--api-key",
            "k",
            "--max-body-size",
            "1MiB",
            "--shutdown-grace-secs",
            "4",
        ]
    )
    engine, settings = configs_from_args(args)
    assert (engine.model, engine.device, engine.dtype, engine.block_size) == ("/m", "cpu", "bfloat16", 32)
    assert (engine.kv_cache_memory, engine.num_blocks, engine.gpu_memory_utilization) == (512 << 20, None, None)
    assert (engine.max_model_len, engine.admission.max_num_seqs) == (4096, 3)
    assert (engine.admission.max_queue_depth, engine.admission.max_wait_secs) == (7, 2.5)
    assert engine.attention_backend == "torch"
    assert (settings.host, settings.port, settings.api_key, settings.max_body_bytes, settings.shutdown_grace_secs) == (
        "::1",
        0,
        "k",
        1 << 20,
        4.0,
    )
    defaults, default_settings = configs_from_args(build_parser().parse_args([]))
    assert defaults.model is None and default_settings.host == "127.0.0.1" and default_settings.port == 8000
    assert default_settings.max_body_bytes == 8 << 20
    sharded = configs_from_args(build_parser().parse_args(["--tensor-parallel-size", "2", "--step-timeout-secs", "30"]))
    assert (sharded[0].tensor_parallel_size, sharded[0].step_timeout_secs) == (2, 30.0)
    assert defaults.tensor_parallel_size == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["--num-blocks", "8", "--kv-cache-memory", "1GiB"],
        ["--kv-cache-memory", "lots"],
        ["--gpu-memory-utilization", "1.5"],
        ["--device", "tpu"],
        ["--max-num-seqs", "0"],
    ],
)
def test_bad_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2


def test_exposed_without_key() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.1.2.3")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("example.org")
    assert ServerSettings(host="0.0.0.0").exposed_without_key
    assert not ServerSettings(host="0.0.0.0", api_key="k").exposed_without_key
    assert not ServerSettings().exposed_without_key


class _Process:
    """The server process, its log lines collected by a thread (so the pipe never fills)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "helexa.server", *argv],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def find(self, pattern: str) -> re.Match | None:
        return next((m for line in list(self.lines) if (m := re.search(pattern, line))), None)


@pytest.fixture(scope="module")
def cli_server(tiny_model_dir: Path) -> Iterator[tuple[_Process, str]]:
    env = {**os.environ, "HELEXA_API_KEY": KEY, "TRITON_INTERPRET": "1"}
    process = _Process(
        [
            "--model",
            str(tiny_model_dir),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--attention-backend",
            "torch",
            "--num-blocks",
            "128",
            "--port",
            "0",
            "--max-num-seqs",
            "1",
            "--max-queue-depth",
            "4",
            "--max-wait-secs",
            "0.5",
            "--shutdown-grace-secs",
            "0.5",
        ],
        env,
    )
    try:
        assert wait_for(lambda: process.find(r"helexa: serving") or process.proc.poll() is not None, 60), process.lines
        match = process.find(r"on http://127\.0\.0\.1:(\d+)")
        assert match, "\n".join(process.lines)
        yield process, f"http://127.0.0.1:{match.group(1)}"
    finally:
        if process.proc.poll() is None:
            process.proc.kill()
        process.proc.wait(timeout=10)


def _auth(key: str = KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_startup_line(cli_server: tuple[_Process, str], tiny_model_dir: Path) -> None:
    process, _ = cli_server
    line = process.find(r"helexa: serving .*").group(0)
    assert str(tiny_model_dir) in line and "device=cpu" in line and "dtype=float32" in line
    assert "kv=128 blocks x 16 tokens = 2048 tokens" in line
    assert sum("helexa: serving" in x for x in process.lines) == 1
    assert process.find(r"engine core: started \(pid \d+\)")  # the default: the engine core in its own process
    for who in ("server", "engine core"):  # each froze its loaded heap (no collector pause walks it)
        assert process.find(rf"{who}: heap frozen after load: [1-9]\d* objects"), process.lines
    assert KEY not in "\n".join(process.lines)  # the key is never logged


def test_api_key(cli_server: tuple[_Process, str]) -> None:
    _, url = cli_server
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    for headers in ({}, _auth("wrong-key"), {"authorization": KEY}, {"authorization": f"Basic {KEY}"}):
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 401 and "retry-after" not in response.headers
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
    assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, timeout=10).status_code == 401
    assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, headers=_auth(), timeout=10).status_code == 200
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # open
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200  # open
    ok = httpx.post(f"{url}/v1/completions", json=body, headers=_auth(), timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_kv_timeout_then_sigterm_drains_and_exits_0(cli_server: tuple[_Process, str]) -> None:
    process, url = cli_server
    holder = raw_post(
        url, "/v1/completions", {"prompt": "hello", "max_tokens": 1800, "stream": True, "ignore_eos": True}, _auth()
    )
    try:
        read_until(holder, b"data: ")
        # The only sequence slot is busy for ~1800 more tokens, far beyond --max-wait-secs 0.5.
        late = httpx.post(
            f"{url}/v1/chat/completions",
            headers=_auth(),
            timeout=30,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        assert late.status_code == 503 and int(late.headers["retry-after"]) >= 1
        assert late.json()["error"]["code"] == "kv_timeout"

        process.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: process.find("draining"), 5), process.lines
        refused = httpx.post(
            f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=_auth(), timeout=10
        )
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "shutting_down"
        # Past the 0.5 s grace period the in-flight stream is aborted: an error event, then [DONE].
        tail = read_until(holder, b"data: [DONE]")
        errors = [
            json.loads(line[6:])
            for line in tail.decode().splitlines()
            if line.startswith("data: {") and '"error"' in line
        ]
        assert errors and errors[-1]["error"]["code"] == "request_aborted"
    finally:
        holder.close()
    assert process.proc.wait(timeout=20) == 0
