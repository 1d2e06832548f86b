"""`bench/decode_roofline.py` (a decode step's fused CPU step against the bandwidth of its moment, this tree's
kernels against another commit's) measures what it says: both libraries time the same step in every round,
each round carries its two bandwidth samples, nothing stays patched, and the report groups rounds by the
bandwidth mode they saw."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.support.bench import bench_module


@pytest.fixture
def decode_roofline(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return bench_module("decode_roofline", monkeypatch)


def test_the_report_groups_rounds_by_bandwidth_mode_and_pairs_the_libraries(decode_roofline: ModuleType) -> None:
    base = "baseline abc"
    rounds = [  # the baseline's key first in some rounds, as the shuffled order leaves it
        {base: 0.022, decode_roofline.THIS: 0.020, "bandwidth": [34e9, 36e9]},
        {decode_roofline.THIS: 0.020, base: 0.021, "bandwidth": [35e9, 35e9]},
        {base: 0.018, decode_roofline.THIS: 0.015, "bandwidth": [60e9, 62e9]},
        {decode_roofline.THIS: 0.014, base: 0.028, "bandwidth": [62e9, 34e9]},  # the mode changed within it
    ]
    text = decode_roofline.report(rounds, 700_000_000, "head", split=45.0)
    rows = [line for line in text.splitlines() if line.startswith(("| slow", "| fast", "| mixed"))]
    assert rows == [
        "| slow | 2 | 35.0 | this tree | 20.00 | 100.0% | 35.0 |",
        "| slow | 2 | 35.0 | baseline abc | 21.50 | 93.1% | 32.6 |",
        "| fast | 1 | 61.0 | this tree | 15.00 | 76.5% | 46.7 |",
        "| fast | 1 | 61.0 | baseline abc | 18.00 | 63.8% | 38.9 |",
        "| mixed | 1 | 48.0 | this tree | 14.00 | 104.2% | 50.0 |",
        "| mixed | 1 | 48.0 | baseline abc | 28.00 | 52.1% | 25.0 |",
    ]
    assert "- slow: median 1.075x (lowest 1.050, highest 1.100, 2 rounds)" in text
    assert "- fast: median 1.200x (lowest 1.200, highest 1.200, 1 rounds)" in text
    assert "- mixed: median 2.000x" in text


def test_both_libraries_time_the_default_models_step_and_nothing_stays_patched(
    decode_roofline: ModuleType, default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from helexa.model.quant import native

    if not native.available():
        pytest.skip(f"helexa's CPU kernel is unavailable here: {native.unavailable_reason()}")
    # the benchmark finds the default model's GGUF where the fixture pulled it
    monkeypatch.setenv("HELEXA_HOME", str(default_model_dir.parents[1]))
    library, threads = native.library, torch.get_num_threads()
    args = argparse.Namespace(model="135m", baseline="HEAD", rounds=2, steps=1, context=32, threads=1)
    rounds, nbytes, head = decode_roofline.measure(args)
    assert native.library is library  # the tree's own library is back
    torch.set_num_threads(threads)
    assert head.startswith("CPU: ") and f"kernel path {native.kernel_path()}" in head
    assert nbytes > 50 << 20  # the 135M model's Q4_1 file
    assert len(rounds) == 2
    for r in rounds:
        assert set(r) == {decode_roofline.THIS, "baseline HEAD", "bandwidth"}
        assert r[decode_roofline.THIS] > 0 and r["baseline HEAD"] > 0
        assert len(r["bandwidth"]) == 2 and min(r["bandwidth"]) > 1e8
