"""kv_budget / parse_size: exact arithmetic, clear errors, the same block count on every (re)load."""

from __future__ import annotations

import types

import pytest
import torch

from helexa.kvcache import (
    CPU_DEFAULT_CAP,
    BlockPool,
    KVBudget,
    estimate_activation_bytes,
    kv_budget,
    kv_bytes_per_block,
    parse_size,
)
from helexa.kvcache import budget as budget_module

GiB, MiB = 1 << 30, 1 << 20
SHAPE = dict(block_size=16, num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)
BPB = 2 * 4 * 16 * 2 * 64 * 4  # 65536 bytes per block


@pytest.mark.parametrize(
    "text,expected",
    [
        ("512MiB", 512 * MiB),
        ("2GiB", 2 * GiB),
        ("2gib", 2 * GiB),
        ("1.5G", 3 * GiB // 2),
        ("1GB", 10**9),
        ("64 KiB", 64 << 10),
        ("4096", 4096),
        ("4096B", 4096),
        (" 1t ", 1 << 40),
        (123, 123),
    ],
)
def test_parse_size(text, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "-1GiB", "1.2.3G", "12 parsecs", "0", "0.1B", True, 0])
def test_parse_size_rejects(text) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_bytes_per_block_and_activation_estimate() -> None:
    assert kv_bytes_per_block(16, 4, 2, 64, torch.float32) == BPB
    assert kv_bytes_per_block(16, 4, 2, 64, torch.bfloat16) == BPB // 2
    est = estimate_activation_bytes(
        hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
        vocab_size=1000, max_num_batched_tokens=100, max_num_seqs=8, dtype=torch.float16,
    )  # fmt: skip
    per_token = 3 * 256 + (4 + 4) * 64 + 4 * 64 + 3 * 512
    assert est == 2 * (100 * per_token * 2 + 2 * 8 * 1000 * 4)


def test_cpu_default_is_a_capped_fraction_of_ram() -> None:
    b = kv_budget(**SHAPE, device="cpu", total_memory_bytes=16 * GiB)
    assert isinstance(b, KVBudget) and b.source == "cpu_default"
    assert b.requested_bytes == int(16 * GiB * 0.10) and b.num_blocks == int(16 * GiB * 0.10) // BPB
    big = kv_budget(**SHAPE, device="cpu", total_memory_bytes=512 * GiB)
    assert big.requested_bytes == CPU_DEFAULT_CAP and big.num_blocks == CPU_DEFAULT_CAP // BPB
    # the default never takes more than what is left after weights and activations
    tight = kv_budget(
        **SHAPE, device="cpu", total_memory_bytes=16 * GiB, weight_bytes=15 * GiB, activation_reserve_bytes=900 * MiB
    )
    assert tight.num_blocks == (GiB - 900 * MiB) // BPB


def test_cpu_explicit_sizes() -> None:
    b = kv_budget(**SHAPE, device="cpu", kv_cache_memory="512MiB", total_memory_bytes=8 * GiB)
    assert (b.source, b.num_blocks, b.kv_cache_bytes, b.num_tokens) == ("kv_cache_memory", 8192, 512 * MiB, 8192 * 16)
    b = kv_budget(**SHAPE, device="cpu", num_blocks=1000, total_memory_bytes=8 * GiB)
    assert (b.source, b.num_blocks, b.requested_bytes) == ("num_blocks", 1000, 1000 * BPB)
    line = b.describe()
    assert "\n" not in line and "1000 blocks" in line and "65536 B/block" in line and "num_blocks" in line


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"num_blocks": 0}, "0 blocks.*--num-blocks"),
        ({"kv_cache_memory": "1KiB"}, "0 blocks.*--kv-cache-memory"),
        ({"num_blocks": 200_000}, "200000 blocks.*budget of 131072 blocks.*lower --num-blocks"),
        ({"kv_cache_memory": "9GiB"}, "lower --kv-cache-memory"),
        ({"num_blocks": 4, "kv_cache_memory": "1GiB"}, "not both"),
        ({"gpu_memory_utilization": 0.5}, "CUDA"),
        ({"weight_bytes": 9 * GiB}, "0 blocks"),
        ({"num_blocks": -1}, "non-negative"),
    ],
)
def test_cpu_errors_name_numbers_and_flags(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kv_budget(**SHAPE, device="cpu", total_memory_bytes=8 * GiB, **kwargs)


def test_cpu_reads_physical_memory() -> None:
    b = kv_budget(**SHAPE, device="cpu")
    assert b.total_memory_bytes == budget_module._physical_memory() > 0
    assert b.num_blocks >= 1


def test_cpu_build_free_rebuild_gives_the_same_count() -> None:
    """Ten loads in a row from the same inputs: the same budget and pool size every time."""
    counts = []
    for _ in range(10):
        b = kv_budget(**SHAPE, device="cpu", kv_cache_memory="8MiB", weight_bytes=1 * GiB)
        pool = BlockPool(b.num_blocks, 16, 4, 2, 64, torch.float32, "cpu")
        assert pool.bytes_per_block == b.bytes_per_block and pool.num_free_blocks == b.num_blocks
        pool.allocate(3)
        counts.append((b, pool.num_blocks))
        del pool
    assert len(set(counts)) == 1 and counts[0][1] == 128


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch):
    """A CUDA device of 80 GiB total memory whose free-memory reading changes on every call."""
    readings = iter(range(10**6))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * GiB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: ((40 * GiB) - next(readings) * MiB, 80 * GiB))


def test_cuda_budget_from_totals(fake_cuda) -> None:
    weights, act = 15 * GiB, estimate_activation_bytes(
        hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128,
        vocab_size=128256, max_num_batched_tokens=8192, max_num_seqs=256, dtype=torch.bfloat16,
    )  # fmt: skip
    shape = dict(block_size=16, num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    results = []
    for _ in range(10):
        results.append(kv_budget(**shape, device="cuda", weight_bytes=weights, activation_reserve_bytes=act))
    assert len(set(results)) == 1  # the changing free-memory reading is never used
    b = results[0]
    available = int(80 * GiB * 0.9) - weights - act
    assert (b.source, b.memory_utilization, b.available_bytes) == ("gpu_memory_utilization", 0.9, available)
    assert b.num_blocks == available // (2 * 32 * 16 * 8 * 128 * 2)
    assert "cuda total=80.00GiB x 0.90" in b.describe()
    half = kv_budget(
        **shape, device="cuda:0", weight_bytes=weights, activation_reserve_bytes=act, gpu_memory_utilization=0.5
    )
    assert half.num_blocks == (40 * GiB - weights - act) // b.bytes_per_block
    exact = kv_budget(**shape, device="cuda", weight_bytes=weights, num_blocks=1000)
    assert exact.num_blocks == 1000 and exact.source == "num_blocks"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"num_blocks": 10**7}, "exceeds the budget.*lower --num-blocks or raise --gpu-memory-utilization"),
        ({"weight_bytes": 80 * GiB}, "0 blocks.*raise --gpu-memory-utilization"),
        ({"gpu_memory_utilization": 1.5}, r"\(0, 1\]"),
        ({"gpu_memory_utilization": 0}, r"\(0, 1\]"),
    ],
)
def test_cuda_errors(fake_cuda, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kv_budget(**SHAPE, device="cuda", **kwargs)
