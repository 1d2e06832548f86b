"""`bench/cpu_attention.py` times what it says: with `--sequences`, a batched decode step's attention (each
sequence's one row over its own blocks of one scattered pool), and every contender it times computes the
reference's attention on those inputs; its K/V rate counts every key of every sequence once."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from helexa.kernels import reference
from helexa.model.quant import native
from tests.support.bench import bench_module


@pytest.fixture
def cpu_attention(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return bench_module("cpu_attention", monkeypatch)


def test_batched_inputs_give_each_sequence_its_own_blocks(cpu_attention: ModuleType) -> None:
    q, k_cache, v_cache, tables, seq_lens, starts = cpu_attention.inputs((9, 3, 64), 40, 1, seed=3, sequences=3)
    assert q.shape == (3, 9, 64) and k_cache.shape == v_cache.shape == (10, cpu_attention.BLOCK, 3, 64)
    assert k_cache.dtype == torch.float16 and not (k_cache == 0).all()
    assert tables.shape == (3, 3) and tables.dtype == torch.int32
    assert len(set(tables.flatten().tolist())) == 9 and int(tables.max()) < 10  # no block shared, all in the pool
    assert seq_lens.tolist() == [40, 40, 40] and starts.tolist() == [0, 1, 2, 3]
    one = cpu_attention.inputs((9, 3, 64), 40, 16, seed=3)  # one sequence, a tile of rows: as before
    assert one[0].shape == (16, 9, 64) and one[3].shape == (1, 3) and one[5].tolist() == [0, 16]


def test_every_contender_computes_the_references_attention(cpu_attention: ModuleType) -> None:
    case = cpu_attention.inputs((8, 2, 64), 37, 1, seed=5, sequences=4)
    want = reference.paged_attention(*(t.double() if t.is_floating_point() else t for t in case)).float()
    torch.testing.assert_close(cpu_attention.sdpa_call(case)(), want, rtol=1e-4, atol=1e-4)
    if not native.available():
        pytest.skip(f"the native kernels are unavailable here: {native.unavailable_reason()}")
    got = cpu_attention.call_library(native.library(), case)  # into a NaN-poisoned output
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_kv_rate_counts_every_key_of_every_sequence(cpu_attention: ModuleType) -> None:
    assert cpu_attention.kv_bytes("135m", 2, 100) == 2 * 2 * 100 * 3 * 64 * 2  # K and V, float16
    assert cpu_attention.kv_bytes("8b", 1, 10) == 2 * 10 * 8 * 128 * 2


def test_sequences_must_be_positive_integers(cpu_attention: ModuleType) -> None:
    assert cpu_attention._ints("1,16,64") == [1, 16, 64]
    for bad in ("0", "4,x", "-2", ""):
        with pytest.raises(SystemExit, match="positive integers"):
            cpu_attention._ints(bad)
