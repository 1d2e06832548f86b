"""Security: a warning when exposed without a key, the API key never in logs (and compared in constant time),
and only safetensors weights are ever loaded (`.bin`-only directories are refused at start-up)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from helexa.engine.engine import Engine
from helexa.server import middleware
from helexa.server.app import create_app
from helexa.server.serve import HelexaServer
from helexa.server.settings import ServerSettings
from tests.support.servers import tiny_engine_config

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-helexa-secret-7f3a9c1e5b"


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    running = Engine(tiny_engine_config(tiny_model_dir, num_blocks=64, max_num_seqs=2))
    running.start()
    yield running
    running.shutdown(0.0)


@contextmanager
def _serve(engine: Engine, settings: ServerSettings) -> Iterator[str]:
    """Serve `engine` with `settings` (any host, any log level) on a socket bound to 127.0.0.1 only.

    uvicorn uses the socket it is given, so `settings.host` can name a non-loopback address for the
    start-up checks while nothing listens beyond this machine.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = HelexaServer(create_app(engine, settings), engine, settings)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert server.started, "the server did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.mark.parametrize(
    ("host", "api_key", "warned"),
    [("0.0.0.0", None, True), ("10.1.2.3", None, True), ("0.0.0.0", KEY, False), ("127.0.0.1", None, False)],
)
def test_exposed_without_a_key_logs_a_warning(
    engine: Engine, caplog: pytest.LogCaptureFixture, host: str, api_key: str | None, warned: bool
) -> None:
    settings = ServerSettings(host=host, port=0, api_key=api_key, log_level="warning")
    with caplog.at_level(logging.INFO, logger="helexa.server"), _serve(engine, settings) as url:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "without an API key" in r.getMessage()
    ]
    assert len(warnings) == int(warned), [r.getMessage() for r in caplog.records]
    if warned:
        assert host in warnings[0] and "--api-key" in warnings[0]


def test_api_key_never_logged_and_compared_in_constant_time(
    engine: Engine, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real_compare = middleware.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real_compare(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    settings = ServerSettings(host="127.0.0.1", port=0, api_key=KEY, log_level="debug")
    body = {"prompt": "hello", "max_tokens": 2}
    with caplog.at_level(logging.DEBUG), _serve(engine, settings) as url:
        ok = httpx.post(f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=30)
        assert ok.status_code == 200
        stream = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=30,
            headers={"authorization": f"Bearer {KEY}"},
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True},
        )
        assert stream.status_code == 200 and "[DONE]" in stream.text
        for headers in (
            {},
            {"authorization": f"Bearer {KEY}x"},
            {"authorization": KEY},
            {"authorization": f"Basic {KEY}"},
            {"authorization": "Bearer wrong"},
        ):
            refused = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            assert KEY not in refused.text
        # an error path that logs the request: a bad body from an authenticated client
        bad = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "x", "max_tokens": -1},
            headers={"authorization": f"Bearer {KEY}"},
            timeout=30,
        )
        assert bad.status_code == 400
    assert caplog.records, "nothing was logged: the capture is not working"
    for record in caplog.records:
        text = " ".join([record.getMessage(), str(record.args), record.exc_text or ""])
        assert KEY not in text, f"the API key leaked into a log line: {record.name}: {record.getMessage()}"
    out, err = capfd.readouterr()
    assert KEY not in out and KEY not in err
    assert any(a == KEY.encode() or b == KEY.encode() for a, b in compared)  # checked with hmac.compare_digest


def test_pickle_only_model_directory_is_refused_at_startup(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "pickled"
    model.mkdir()
    for item in tiny_model_dir.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy(item, model / item.name)
    # Never unpickled, so any bytes do: a loader that opened it would fail differently (or run code).
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04\x95not really a pickle")
    assert json.loads((model / "config.json").read_text())  # everything but the weights is there
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "helexa.server",
            "--model",
            str(model),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--attention-backend",
            "torch",
            "--num-blocks",
            "16",
            "--port",
            "0",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "pytorch_model.bin" in output and "safetensors" in output and "pickle" in output, output
    assert "helexa: serving" not in output and "Traceback" not in output
