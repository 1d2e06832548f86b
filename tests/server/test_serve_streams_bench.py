"""`bench/serve_streams.py` measures what it says: this tree's server serves every load, each load's rate and
each process's CPU a token come back, and the server (with its core) is gone afterwards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.bench import bench_module

REPO = Path(__file__).resolve().parents[2]


def test_serve_streams_measures_every_load(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TRITON_INTERPRET", "HELEXA_DEBUG"):  # the suite's settings: the benchmark runs without them
        monkeypatch.delenv(name, raising=False)
    serve_streams = bench_module("serve_streams", monkeypatch)

    before = set(os.listdir("/proc"))
    rows = serve_streams._measure(REPO, tiny_model_dir, tokens=4)
    assert set(rows) == set(serve_streams.LOADS)
    for row in rows.values():
        assert row["rate"] > 0 and row["server us"] >= 0 and row["core us"] >= 0
    assert row["server us"] + row["core us"] > 0  # 64 streams of 4 tokens cost the two processes some CPU
    commands = [_command(p) for p in set(os.listdir("/proc")) - before if p.isdigit()]
    assert not [c for c in commands if b"helexa.server" in c or b"helexa.engine.core" in c]


def _command(pid: str) -> bytes:
    """A process's command line; empty once it has exited (or is a zombie)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
