"""Shared by the reliability tests: fresh in-process servers that fault on cue, RSS, and metric reading."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from helexa.server.settings import ServerSettings
from tests.server.helpers import RunningServer, tiny_engine_config

__all__ = ["DOCUMENTED_ERRORS", "metric", "rss_bytes", "serving"]

# SPEC.md's error table: (status, code) -> whether Retry-After is sent.
DOCUMENTED_ERRORS = {
    (400, "invalid_request"): False,
    (400, "context_length_exceeded"): False,
    (429, "queue_full"): True,
    (503, "kv_timeout"): True,
    (503, "model_reloading"): True,
    (401, "invalid_api_key"): False,
    (413, "request_too_large"): False,
    (500, "device_fault"): False,
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
    """This process's resident set size, from /proc/self/status (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")
