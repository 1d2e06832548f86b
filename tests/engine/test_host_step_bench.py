"""`bench/host_step.py` (host work per engine step, by part) measures what it says: on the tiny model, one case
per speculative mode, every part is timed, the parts fit inside the host work and the host work inside the
step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", ["off", "default"])
def test_host_step_parts_add_up(tiny_model_dir: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    sys.modules.pop("host_step", None)
    import host_step

    row = host_step._measure(str(tiny_model_dir), 4, mode, steps=6)
    assert set(row) == {"step", "host", "forward", "other", *host_step.PARTS}
    assert 0 < row["forward"] < row["step"] and 0 < row["host"] < row["step"]
    assert row["events"] > 0 and row["kv tables"] > 0 and row["pack inputs"] > 0 and row["sample to host"] > 0
    assert (row["drafts"] > 0) == (mode == "default")  # drafts are proposed only with speculation on
    assert sum(row[p] for p in host_step.PARTS) <= row["host"] * 1.5  # medians of parts vs the host's median
