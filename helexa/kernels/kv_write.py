"""Triton `write_kv`: scatter a step's new K/V rows into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helexa.kernels._checks import TRITON_DTYPES, check_write_kv

__all__ = ["write_kv_triton"]


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr,  # (T, KVH, D)
    k_cache_ptr, v_cache_ptr,  # (NB, BS, KVH, D)
    slot_ptr,  # (T,)
    num_kv_heads, block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (token, tile of KV heads); 64-bit addresses, so pools over 2^31 elements work."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    block = slot // block_size
    row = slot % block_size
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    dims = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)  # (BLOCK_H, BLOCK_D)
    heads64 = heads.to(tl.int64)[:, None]
    dims64 = dims.to(tl.int64)[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads64 * stride_kh + dims64 * stride_kd, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads64 * stride_vh + dims64 * stride_vd, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + row * stride_kcs + heads64 * stride_kch + dims64 * stride_kcd
    v_dst = v_cache_ptr + block * stride_vcb + row * stride_vcs + heads64 * stride_vch + dims64 * stride_vcd
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V rows into their cache slots in place, with a Triton kernel.

    k, v: (T, KVH, D); k_cache, v_cache: (NB, BS, KVH, D), one dtype (fp32/fp16/bf16), any strides;
    slot_mapping: (T,) int32/int64. Token t goes to block `slot // BS`, row `slot % BS`; slot -1
    skips it. Nothing else in the caches changes. Raises ValueError for inconsistent arguments.
    """
    check_write_kv(k, v, k_cache, v_cache, slot_mapping, TRITON_DTYPES)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    # One program's tile stays <= 2048 elements: all heads of a token at once for typical shapes.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 2048 // block_d))
    _write_kv_kernel[(num_tokens, triton.cdiv(num_kv_heads, block_h))](
        k, v, k_cache, v_cache, slot_mapping, num_kv_heads, k_cache.shape[1],
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4 if block_h * block_d >= 1024 else 2,
    )  # fmt: skip
