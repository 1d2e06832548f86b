"""`bench/argmax_rows.py` (greedy rows' argmax in the fused step against their logits sampled after it)
measures what it says: its "sampled" mode really turns the step's argmax rows off, both modes give the same
tokens, the timed step runs both ways, and the report pairs them."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.bench import bench_module

pytestmark = pytest.mark.default_model


@pytest.fixture
def argmax_rows(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return bench_module("argmax_rows", monkeypatch)


def test_both_modes_run_the_default_model_and_the_report_pairs_them(
    argmax_rows: ModuleType, default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from helexa.model.quant import native

    if not native.available():
        pytest.skip(f"helexa's CPU kernel is unavailable here: {native.unavailable_reason()}")
    chat = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    plan = {"model_dir": str(default_model_dir), "chat": chat, "streams": [1, 2], "new_tokens": 6, "threads": 1}
    runs = {m: [argmax_rows.run_mode({**plan, "mode": m}, tmp_path)] for m in argmax_rows.MODES}
    assert all("error" not in rs[0] for rs in runs.values()), runs
    assert runs["in step"][0]["argmax_in_step"] and not runs["sampled"][0]["argmax_in_step"]
    assert runs["in step"][0]["tokens"] == runs["sampled"][0]["tokens"]
    assert [len(t) for t in runs["in step"][0]["tokens"]["2"]] == [6, 6]
    monkeypatch.setattr(argmax_rows, "STEP_SHAPES", ((1, 1), (2, 3)))
    steps = argmax_rows.time_steps(str(default_model_dir), [1], 2)  # raises if the modes' tokens differ
    assert [(r["seqs"], r["rows"]) for r in steps] == [(1, 1), (2, 3)] and all(r["in step"] > 0 for r in steps)
    args = argparse.Namespace(streams="1,2", threads=1, rounds=1, new_tokens=6, step_repeats=2)
    text = argmax_rows.report({"135m": runs}, args, native.kernel_path(), {"135m": steps})
    assert f"kernel path {native.kernel_path()}" in text and "CPU: " in text
    assert "| decode, 2 stream(s), tok/s" in text and "| peak RSS (MiB) |" in text
    assert "Same token ids in every round of both modes: yes." in text
    assert "| 1 | 2 x 3 |" in text
    argmax_rows.plot({"135m": runs}, args, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
