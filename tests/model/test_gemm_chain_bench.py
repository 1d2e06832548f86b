"""`bench/gemm_chain.py` (a one-row step's GEMMs one after another against one GEMM of the same bytes) measures
what it says: the chain is the model's projections in a step's order, the one GEMM reads as many bytes, both are
timed in every round with the round's bandwidth samples, and the report's columns follow from the rounds."""

from __future__ import annotations

import argparse
from types import ModuleType

import pytest
import torch

from tests.support.bench import bench_module


@pytest.fixture
def gemm_chain(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return bench_module("gemm_chain", monkeypatch)


def test_the_chain_is_a_steps_projections_in_order(gemm_chain: ModuleType) -> None:
    one_b = gemm_chain.projections("1b")
    assert len(one_b) == 22 * 4
    assert one_b[:4] == [(2048 + 2 * 256, 2048), (2048, 2048), (2 * 5632, 2048), (2048, 5632)]
    small = gemm_chain.projections("135m")
    assert len(small) == 30 * 4 and small[:4] == [(576 + 2 * 192, 576), (576, 576), (3072, 576), (576, 1536)]


def test_the_report_groups_rounds_by_mode_and_takes_the_calls_python_off(gemm_chain: ModuleType) -> None:
    chain, one = gemm_chain.CHAIN, gemm_chain.ONE
    rounds = [  # the one GEMM reads 1% more bytes (whole tiles of 16 columns); 10 calls of 10 us from Python
        {chain: 0.020, one: 0.0101, "bandwidth": [34e9, 36e9], "bytes": {chain: 700e6, one: 707e6}, "python": 1e-4},
        {chain: 0.013, one: 0.0101, "bandwidth": [60e9, 62e9], "bytes": {chain: 700e6, one: 707e6}, "python": 1e-4},
    ]
    text = gemm_chain.report(rounds, 10, "head", split=45.0)
    rows = [line for line in text.splitlines() if line.startswith(("| slow", "| fast"))]
    assert rows == [
        "| slow | 1 | 35.0 | 100.0% | 200.0% | 2.000x | 100.5% | 990.0 |",
        "| fast | 1 | 61.0 | 88.3% | 114.8% | 1.300x | 89.0% | 290.0 |",
    ]


def test_both_contenders_read_the_same_bytes_every_round(gemm_chain: ModuleType) -> None:
    from helexa.model.quant import native

    if not native.available():
        pytest.skip(f"helexa's CPU kernel is unavailable here: {native.unavailable_reason()}")
    threads = torch.get_num_threads()
    try:
        args = argparse.Namespace(model="135m", rounds=1, repeats=1, threads=1)
        rounds, nbytes, calls, head = gemm_chain.measure(args)
    finally:
        torch.set_num_threads(threads)
    assert calls == 120 and "kernel path" in head and len(rounds) == 1
    (r,) = rounds
    assert r["bytes"][gemm_chain.CHAIN] == nbytes
    assert nbytes <= r["bytes"][gemm_chain.ONE] < nbytes * 1.01  # whole tiles of 16 columns at most
    assert r[gemm_chain.CHAIN] > 0 and r[gemm_chain.ONE] > 0 and r["python"] > 0
    assert all(bw > 1e9 for bw in r["bandwidth"])
