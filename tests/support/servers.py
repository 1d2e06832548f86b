"""Server test support: a tiny chat model directory, a real engine behind a real uvicorn server on
127.0.0.1 (any free port, a daemon thread), servers that fault on cue, raw sockets, metrics and RSS.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helexa.config import EngineConfig
from helexa.engine import start_engine
from helexa.engine.core import engine_process_enabled
from helexa.heap import resident_bytes
from helexa.model.text.tokenizer import Tokenizer
from helexa.server.app import create_app
from helexa.server.serve import HelexaServer
from helexa.server.settings import ServerSettings
from tests.support.engines import tiny_engine_config
from tests.support.models import build_tiny_tokenizer_dir, make_tiny_model


def make_tiny_model_dir(path: Path, max_position_embeddings: int = 2048) -> Path:
    """A tiny random Llama (2 layers, hidden 64) with the tiny BPE tokenizer and chat template, under `path`."""
    tok_dir = build_tiny_tokenizer_dir(Path(path) / "tok")
    tok = Tokenizer.from_pretrained(tok_dir)
    model_dir = make_tiny_model(
        Path(path),
        "llama",
        seed=3,
        name="tiny-chat",
        vocab_size=tok.vocab_size,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        max_position_embeddings=max_position_embeddings,
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (model_dir / name).write_bytes((tok_dir / name).read_bytes())
    return model_dir


class RunningServer:
    """A real engine behind a real uvicorn server on 127.0.0.1 (any free port), in a daemon thread.

    `url` is the base URL; `engine` and `app` are the live objects. `stop()` is bounded (about 10 s).
    `in_process`: False runs the engine core in its own process (None: as `HELEXA_ENGINE_PROCESS` says, but in
    this process when it is unset, unlike `python -m helexa.server`: a core process costs each of the suite's
    hundreds of servers seconds to start; `tests/server/test_core_process.py` and the CLI tests run the core).
    """

    def __init__(
        self, config: EngineConfig, settings: ServerSettings | None = None, *, in_process: bool | None = None
    ) -> None:
        settings = dataclasses.replace(settings or ServerSettings(), host="127.0.0.1", port=0, log_level="warning")
        if in_process is None:
            in_process = not engine_process_enabled(default=False)
        self.engine = start_engine(config, in_process)
        self.app = create_app(self.engine, settings)
        self.server = HelexaServer(self.app, self.engine, settings)
        self.thread = threading.Thread(target=self.server.run, name="helexa-test-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while self.server.bound_port is None and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # uvicorn sets `started` before the port is read back: wait for the port
        if self.server.bound_port is None:
            self.engine.shutdown(0.0)
            raise RuntimeError("the test server did not start within 30 s")
        self.url = f"http://127.0.0.1:{self.server.bound_port}"

    def stop(self) -> None:
        """Stop uvicorn, then the engine."""
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.shutdown(0.0)


def wait_for(predicate, timeout: float, interval: float = 0.02) -> bool:
    """Poll `predicate()` until it is truthy or `timeout` seconds pass; returns its last truth value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def raw_post(url: str, path: str, body: dict, headers: dict[str, str] | None = None) -> socket.socket:
    """Send a JSON POST on a fresh socket and return it unread (the test decides when to read or close)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{head}"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def read_until(sock: socket.socket, marker: bytes, limit: int = 1 << 20) -> bytes:
    """Read from `sock` until `marker` arrives (bounded by the socket timeout and `limit` bytes)."""
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        if not chunk or len(data) > limit:
            raise AssertionError(f"{marker!r} never arrived; got {data[:300]!r}")
        data += chunk
    return data


# The documented errors (docs/reference.md): (status, code) -> whether Retry-After is sent.
DOCUMENTED_ERRORS = {
    (400, "invalid_request"): False,
    (400, "context_length_exceeded"): False,
    (429, "queue_full"): True,
    (503, "kv_timeout"): True,
    (503, "model_reloading"): True,
    (401, "invalid_api_key"): False,
    (413, "request_too_large"): False,
    (415, "unsupported_media_type"): False,
    (408, "request_timeout"): False,
    (503, "overloaded"): False,
    (500, "device_fault"): False,
    (500, "template_error"): False,
}


@contextlib.contextmanager
def serving(
    model_dir: Path, inject: str = "", settings: ServerSettings | None = None, **overrides
) -> Iterator[RunningServer]:
    """A fresh in-process server on 127.0.0.1 whose engine faults at model steps `inject` (HELEXA_FAULT_INJECT).

    The variable is set only while the Engine is constructed (it reads it there), so servers built
    later are not affected. `overrides` go to `tiny_engine_config`; `settings` to the server.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HELEXA_FAULT_INJECT", inject)
        running = RunningServer(tiny_engine_config(model_dir, **overrides), settings)
    try:
        yield running
    finally:
        running.stop()


def metric(text: str, name: str) -> float:
    """The value of the unlabelled sample `name` in a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def rss_bytes() -> int:
    """This process's resident set size (`helexa.heap.resident_bytes`); RuntimeError where it cannot be read."""
    rss = resident_bytes()
    if not rss:
        raise RuntimeError("the resident set cannot be read here (no /proc/self/statm)")
    return rss
