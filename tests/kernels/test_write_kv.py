"""Triton write_kv (in the interpreter) against the torch reference."""

from __future__ import annotations

import os

import pytest
import torch

from helexa.kernels import reference, write_kv_triton

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run in the Triton interpreter"
)


def _caches(num_blocks, block_size, kv_heads, head_dim, dtype, gen):
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_heads,head_dim,block_size", [(2, 64, 16), (1, 128, 8), (3, 80, 32), (8, 256, 16)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_scatter_matches_reference_and_skips_minus_one(dtype, kv_heads, head_dim, block_size, slot_dtype):
    gen = torch.Generator().manual_seed(head_dim + kv_heads)
    num_blocks, tokens = 9, 13
    k_cache, v_cache = _caches(num_blocks, block_size, kv_heads, head_dim, dtype, gen)
    k = torch.randn((tokens, kv_heads, head_dim), generator=gen).to(dtype)
    v = torch.randn((tokens, kv_heads, head_dim), generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 7]] = -1  # padding tokens
    slots = slots.to(slot_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k, v, k_ref, v_ref, slots)
    before = k_cache.clone()
    write_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # the written rows changed, everything else (including what slot -1 would have hit) did not
    changed = (k_cache != before).any(-1).any(-1).flatten()  # (NB*BS,)
    kept = slots[slots >= 0].long()
    assert set(torch.nonzero(changed).flatten().tolist()) <= set(kept.tolist())
    assert changed[kept].sum() >= len(kept) - 1  # random rows differ almost surely


def test_strided_inputs_and_cache():
    """k and v as views of a fused projection; the caches as one [2, ...] tensor's halves."""
    gen = torch.Generator().manual_seed(4)
    kv = torch.randn((5, 2, 16, 2, 64), generator=gen)  # (NB...) of both caches
    k_cache, v_cache = kv[:, 0], kv[:, 1]  # (5, 16, 2, 64) each, non-contiguous
    qkv = torch.randn((7, 8, 64), generator=gen)
    k, v = qkv[:, 4:6], qkv[:, 6:8]  # (7, 2, 64) each, token stride 8*64
    slots = torch.tensor([3, 17, 79, -1, 40, 41, 0])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k, v, k_ref, v_ref, slots)
    write_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_reference_writes_rows_where_slots_say():
    k_cache = torch.zeros((3, 4, 1, 2))
    v_cache = torch.zeros((3, 4, 1, 2))
    k = torch.arange(1.0, 7.0).view(3, 1, 2)
    reference.write_kv(k, -k, k_cache, v_cache, torch.tensor([9, -1, 0]))
    assert k_cache[2, 1, 0].tolist() == [1.0, 2.0] and k_cache[0, 0, 0].tolist() == [5.0, 6.0]
    assert v_cache[2, 1, 0].tolist() == [-1.0, -2.0]
    assert int((k_cache != 0).sum()) == 4


def test_empty_step_is_a_no_op():
    k_cache = torch.randn((2, 8, 1, 64))
    before = k_cache.clone()
    write_kv_triton(
        torch.empty(0, 1, 64), torch.empty(0, 1, 64), k_cache, k_cache.clone(), torch.empty(0, dtype=torch.int64)
    )
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize(
    "k_shape,slots,dtype,match",
    [
        ((4, 2, 32), torch.zeros(4, dtype=torch.int64), torch.float32, "k must be"),
        ((4, 2, 64), torch.zeros(3, dtype=torch.int64), torch.float32, "slot_mapping must be"),
        ((4, 2, 64), torch.zeros(4), torch.float32, "int32 or int64"),
        ((4, 2, 64), torch.zeros(4, dtype=torch.int64), torch.float16, "dtype"),
        ((4, 2, 64), torch.tensor([0, 1, 2, 16 * 5]), torch.float32, r"slot_mapping values"),
    ],
    ids=["head-dim", "slots-len", "slots-dtype", "dtype", "slot-range"],
)
def test_bad_arguments_raise_value_error(k_shape, slots, dtype, match):
    k_cache = torch.randn((5, 16, 2, 64))
    k = torch.randn(k_shape).to(dtype)
    with pytest.raises(ValueError, match=match):
        write_kv_triton(k, k.clone(), k_cache, k_cache.clone(), slots)
    with pytest.raises(ValueError, match=match):
        reference.write_kv(k, k.clone(), k_cache, k_cache.clone(), slots)
