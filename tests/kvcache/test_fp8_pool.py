"""fp8 pools: exact byte counts in the budget, scales per layer and KV head, carried by each layer's pair."""

from __future__ import annotations

import pytest
import torch

from helexa.kernels import FP8_KV_DTYPE, FP8_KV_MAX
from helexa.kvcache import BlockPool, LayerKV, fp8_scales, kv_budget, kv_bytes_per_block, kv_scale_bytes

SHAPE = dict(block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)


@pytest.mark.parametrize("memory", [64 << 20, 100_000_003, 3 << 30])
def test_same_memory_gives_exactly_4x_float32_and_2x_bfloat16_blocks(memory):
    counts = {
        dtype: kv_budget(**SHAPE, dtype=dtype, device="cpu", kv_cache_memory=memory, total_memory_bytes=64 << 30)
        for dtype in (torch.float32, torch.bfloat16, FP8_KV_DTYPE)
    }
    fp8 = counts[FP8_KV_DTYPE]
    assert fp8.bytes_per_block * 4 == counts[torch.float32].bytes_per_block
    assert fp8.bytes_per_block == 2 * 30 * 16 * 3 * 64  # one byte per element
    # floor(m / (b/4)) is 4 floor(m / b) only when the remainder allows: compare with the exact counts
    assert fp8.num_blocks == memory // (kv_bytes_per_block(**SHAPE, dtype=torch.float32) // 4)
    assert fp8.num_blocks == memory // (kv_bytes_per_block(**SHAPE, dtype=torch.bfloat16) // 2)
    if memory % counts[torch.float32].bytes_per_block < fp8.bytes_per_block:
        assert fp8.num_blocks == 4 * counts[torch.float32].num_blocks


def test_fp8_budget_on_a_multiple_of_the_block_size_is_exactly_4x():
    memory = 1000 * kv_bytes_per_block(**SHAPE, dtype=torch.float32)
    f32 = kv_budget(**SHAPE, dtype=torch.float32, device="cpu", kv_cache_memory=memory)
    bf16 = kv_budget(**SHAPE, dtype=torch.bfloat16, device="cpu", kv_cache_memory=memory)
    fp8 = kv_budget(**SHAPE, dtype=FP8_KV_DTYPE, device="cpu", kv_cache_memory=memory)
    assert (f32.num_blocks, bf16.num_blocks, fp8.num_blocks) == (1000, 2000, 4000)


def test_scales_come_off_the_available_memory_not_the_requested_pool():
    assert kv_scale_bytes(30, 3, FP8_KV_DTYPE) == 2 * 30 * 3 * 4
    assert kv_scale_bytes(30, 3, torch.bfloat16) == 0
    total, weights = 1 << 30, 100 << 20
    f32 = kv_budget(**SHAPE, dtype=torch.float32, device="cpu", weight_bytes=weights, total_memory_bytes=total)
    fp8 = kv_budget(**SHAPE, dtype=FP8_KV_DTYPE, device="cpu", weight_bytes=weights, total_memory_bytes=total)
    assert f32.scale_bytes == 0 and fp8.scale_bytes == 720
    assert fp8.available_bytes == f32.available_bytes - 720
    assert "kv scales=720B" in fp8.describe() and "kv scales" not in f32.describe()
    # a budget that fits the blocks but not the scales as well is refused
    exact = fp8.bytes_per_block * 10
    with pytest.raises(ValueError, match="exceeds the budget"):
        kv_budget(**SHAPE, dtype=FP8_KV_DTYPE, device="cpu", num_blocks=10, total_memory_bytes=exact)
    assert kv_budget(**SHAPE, dtype=FP8_KV_DTYPE, device="cpu", num_blocks=10, total_memory_bytes=exact + 720)


def test_pool_allocates_fp8_caches_with_scales_carried_by_each_layer_pair():
    pool = BlockPool(6, 4, 3, 2, 8, FP8_KV_DTYPE, "cpu")
    assert pool.quantized and pool.bytes_per_block == 2 * 3 * 4 * 2 * 8
    assert pool.kv_scales is not None and pool.kv_scales.shape == (3, 2, 2) and (pool.kv_scales == 1).all()
    pairs = pool.kv_caches()
    for layer, pair in enumerate(pairs):
        k, v = pair  # still a pair
        assert isinstance(pair, LayerKV) and k is pool.k_cache(layer) and v is pool.v_cache(layer)
        assert k.dtype == FP8_KV_DTYPE and set(pair.scales) == {"k_scale", "v_scale"}
    k_scale = torch.arange(1.0, 7.0).view(3, 2)
    pool.set_kv_scales(k_scale, k_scale / 10)
    assert torch.equal(pairs[2].scales["k_scale"], torch.tensor([5.0, 6.0]))  # views: updated in place
    assert torch.equal(pairs[0].scales["v_scale"], torch.tensor([0.1, 0.2]))
    pool.check_integrity()
    with pytest.raises(ValueError, match="finite and > 0"):
        pool.set_kv_scales(k_scale, -k_scale)
    with pytest.raises(ValueError, match=r"k_scale must be \[3, 2\]"):
        pool.set_kv_scales(k_scale[:2], k_scale[:2])


def test_unquantized_pool_pairs_carry_no_scales():
    pool = BlockPool(6, 4, 2, 2, 8, torch.float32, "cpu")
    assert not pool.quantized and pool.kv_scales is None
    assert all(pair.scales == {} for pair in pool.kv_caches())
    with pytest.raises(ValueError, match="fp8 pool"):
        pool.set_kv_scales(torch.ones(2, 2), torch.ones(2, 2))


def test_fp8_scales_map_twice_the_calibrated_max_to_448():
    amax = torch.tensor([1.0, 448.0, 0.0, float("inf")])
    scales = fp8_scales(amax)
    assert torch.equal(scales[:2], amax[:2] * 2 / FP8_KV_MAX)
    assert scales[2] == 1.0 and scales[3] == 1.0  # nothing seen (or nothing finite): scale 1
    assert torch.equal(fp8_scales(amax[:2], margin=1.0), amax[:2] / FP8_KV_MAX)
