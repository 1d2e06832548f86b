"""`bench/gemm_rows.py` (the quantized GEMM by row count, this tree's kernels against another commit's) measures
what it says: a layer's four projections and the head at the model's shapes, every row count timed with every
library each round, the bits compared, and the report's columns follow from the rounds."""

from __future__ import annotations

import argparse
from types import ModuleType

import pytest
import torch

from tests.support.bench import bench_module


@pytest.fixture
def gemm_rows(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return bench_module("gemm_rows", monkeypatch)


def test_the_weights_are_a_layers_projections_and_the_head(gemm_rows: ModuleType) -> None:
    import numpy as np

    kinds = gemm_rows.weights("135m", np.random.default_rng(0))
    layer, head = kinds["int4 layer"], kinds["int8 head"]
    assert [(w.n, w.k, w.bits) for w in layer] == [(960, 576, 4), (576, 576, 4), (3072, 576, 4), (576, 1536, 4)]
    assert [(w.n, w.k, w.bits) for w in head] == [(49_152, 576, 8)]
    assert layer[0].q.numel() == 960 * 576 // 2 and head[0].q.dtype == torch.int8
    assert gemm_rows.macs(layer, 4) == 4 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536)


def test_the_report_gives_rates_and_ratios_from_the_rounds(gemm_rows: ModuleType) -> None:
    this, base = gemm_rows.THIS, "baseline HEAD~1"
    rounds = [
        {"int4 layer|4": {this: 0.001, base: 0.002}, "int8 head|4": {this: 0.004, base: 0.004}},
        {"int4 layer|4": {this: 0.002, base: 0.003}, "int8 head|4": {this: 0.004, base: 0.006}},
    ]
    per_row = {"int4 layer": 1_000_000, "int8 head": 2_000_000}
    text = gemm_rows.report(rounds, per_row, "head")
    rows = [line for line in text.splitlines() if line.startswith("| int")]
    # medians over rounds: 1.5 ms and 2.5 ms for 4 M multiply-adds; ratios 2.0 and 1.5 -> 1.75
    assert rows == ["| int4 layer | 4 | 2.7 | 1.6 | 1.750x |", "| int8 head | 4 | 2.0 | 1.6 | 1.250x |"]
    assert f"| weights | rows | {this}, GMAC/s | {base}, GMAC/s | {base} / {this} |" in text


def test_every_row_count_is_timed_and_the_bits_checked(gemm_rows: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    from helexa.model.quant import native

    if not native.available():
        pytest.skip(f"helexa's CPU kernel is unavailable here: {native.unavailable_reason()}")
    threads = torch.get_num_threads()
    try:
        args = argparse.Namespace(model="135m", baseline=None, rows=[1, 5], rounds=1, repeats=1, threads=1)
        rounds, per_row, head = gemm_rows.measure(args)
    finally:
        torch.set_num_threads(threads)
    assert "kernel path" in head and len(rounds) == 1
    assert set(rounds[0]) == {"int4 layer|1", "int4 layer|5", "int8 head|1", "int8 head|5"}
    assert all(t[gemm_rows.THIS] > 0 for t in rounds[0].values())
    assert per_row == {"int4 layer": 960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536, "int8 head": 49_152 * 576}

    # a library whose bits differ fails the run
    real = gemm_rows.Weight.gemm

    def off_by_one(self: object, lib: object, x: torch.Tensor, y: torch.Tensor) -> None:
        real(self, lib, x, y)
        if lib is not native.library():
            y[0, 0] += 1.0

    monkeypatch.setattr(gemm_rows.Weight, "gemm", off_by_one)
    other = native.load_path(native.isa.PATHS[native.kernel_path()])[0]
    import bench.decode_roofline

    monkeypatch.setattr(bench.decode_roofline, "baseline_library", lambda rev, path: other)
    args = argparse.Namespace(model="135m", baseline="X", rows=[1], rounds=1, repeats=1, threads=1)
    try:
        with pytest.raises(SystemExit, match="differ at int4 layer, 1 rows"):
            gemm_rows.measure(args)
    finally:
        torch.set_num_threads(threads)
