"""`bench/host_step.py` (host work per engine step, by part) measures what it says: on the tiny model, one case
per speculative mode, every part is timed, the parts fit inside the host work and the host work inside the
step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.bench import bench_module


@pytest.mark.parametrize("mode", ["off", "default"])
def test_host_step_parts_add_up(tiny_model_dir: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    host_step = bench_module("host_step", monkeypatch)

    # attention_backend: the CPU kernels the benchmark measures, not the suite's Triton interpreter (~10x as long)
    row = host_step._measure(str(tiny_model_dir), 4, mode, steps=6, attention_backend="torch")
    assert set(row) == {"step", "host", "forward", "forward python", "other", *host_step.PARTS}
    assert 0 < row["forward"] < row["step"] and 0 < row["host"] < row["step"]
    assert row["forward python"] == 0  # torch layers: the whole forward is the model's compute
    assert row["events"] > 0 and row["kv tables"] > 0 and row["pack inputs"] > 0 and row["sample to host"] > 0
    assert (row["drafts"] > 0) == (mode == "default")  # drafts are proposed only with speculation on
    assert sum(row[p] for p in host_step.PARTS) <= row["host"] * 1.5  # medians of parts vs the host's median


def test_host_step_counts_the_python_around_a_fused_step(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a model on the fused CPU step, the model's compute is the native calls alone: the Python around them
    is host work, in its own part, and the host work is the step less those calls."""
    host_step = bench_module("host_step", monkeypatch)

    from helexa.model.quant import native

    library, threads = native.library, torch.get_num_threads()
    row = host_step._measure(str(tiny_model_dir), 4, "off", steps=6, quantization="int4")
    assert native.library is library and torch.get_num_threads() == threads  # nothing left patched
    assert 0 < row["forward python"] < row["forward"] < row["step"]
    assert row["host"] >= row["forward python"]  # each step's host work holds its forward's Python
