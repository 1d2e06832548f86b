"""The device scripts run on the CPU in their dry-run mode, so a change that breaks them shows here, not
only in a session that is lent a GPU (`bench/gpu_check.sh` runs them there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "script, args, marker",
    [
        ("gpu_engine.py", ["--formats", "int4"], "| ok |"),
        ("gpu_invariance.py", [], "bitwise"),
        ("gpu_serve.py", ["--formats", "int4"], "| int4 | 4 |"),
    ],
    ids=["engine end to end", "invariance survey", "serving an 8B shape"],
)
def test_a_device_script_runs_through_on_the_cpu(script: str, args: list[str], marker: str, tmp_path: Path) -> None:
    out = tmp_path / "table.md"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # each script sets what it needs
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), "--dry-run", "--out", str(out), *args],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = out.read_text()
    assert marker in table
    assert "FAIL" not in table and "ERROR" not in table
