"""Triton `write_kv`: scatter a step's new K/V rows into their paged-cache slots (quantizing for fp8 caches)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helexa.kernels._checks import FP8_KV_MAX, TRITON_DTYPES, check_write_kv

__all__ = ["write_kv_triton"]

FP8_MAX = tl.constexpr(FP8_KV_MAX)


@triton.jit
def _round_to_e4m3_grid(x):
    """fp32 x with |x| <= 448 rounded to the nearest e4m3 value (ties to even), still in fp32.

    Adding then subtracting 1.5 * 2^(e + 20), where 2^e is x's binade (at least 2^-6, the smallest
    normal e4m3 binade), rounds x to a multiple of 2^(e - 3): e4m3's spacing there (3 mantissa bits;
    2^-9 across the subnormals). The cast to e4m3 that follows is then exact, so the result does
    not depend on the rounding of the conversion (the interpreter's is not round-to-nearest-even).
    The sign is x's, so -0.0 and tiny negatives give -0.0, as torch's cast does.
    """
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # biased fp32 exponent
    magic = (((exponent + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2^(e + 20)
    rounded = (tl.abs(x) + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # x's sign


@triton.jit
def _quantize_e4m3(x, scale):
    """x / scale (IEEE division, as torch's) saturated to ±448 and rounded to e4m3, still in fp32."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    return _round_to_e4m3_grid(y)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr,  # (T, KVH, D)
    k_cache_ptr, v_cache_ptr,  # (NB, BS, KVH, D)
    slot_ptr,  # (T,)
    k_scale_ptr, v_scale_ptr,  # (KVH,) fp32 — read only for fp8 caches
    num_kv_heads, block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (token, tile of KV heads); 64-bit addresses, so pools over 2^31 elements work.
    An fp8 (e4m3) cache stores x / scale of its KV head, saturated to ±448."""
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
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:  # static: the cache's dtype
        h_valid = heads < num_kv_heads
        k_scale = tl.load(k_scale_ptr + heads, mask=h_valid, other=1.0)  # (BLOCK_H,)
        v_scale = tl.load(v_scale_ptr + heads, mask=h_valid, other=1.0)
        k = _quantize_e4m3(k, k_scale[:, None])
        v = _quantize_e4m3(v, v_scale[:, None])
    k_dst = k_cache_ptr + block * stride_kcb + row * stride_kcs + heads64 * stride_kch + dims64 * stride_kcd
    v_dst = v_cache_ptr + block * stride_vcb + row * stride_vcs + heads64 * stride_vch + dims64 * stride_vcd
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter new K/V rows into their cache slots in place, with a Triton kernel.

    k, v: (T, KVH, D) fp32/fp16/bf16; k_cache, v_cache: (NB, BS, KVH, D) of k's dtype, or fp8 (e4m3)
    with `k_scale`, `v_scale` (KVH,) float32, any strides; slot_mapping: (T,) int32/int64. Token t goes
    to block `slot // BS`, row `slot % BS`; slot -1 skips it. Nothing else in the caches changes. An
    fp8 cache gets exactly `reference.quantize_fp8(k, k_scale)`. Raises ValueError for inconsistent
    arguments.
    """
    check_write_kv(k, v, k_cache, v_cache, slot_mapping, TRITON_DTYPES, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    # One program's tile stays <= 2048 elements: all heads of a token at once for typical shapes.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 2048 // block_d))
    _write_kv_kernel[(num_tokens, triton.cdiv(num_kv_heads, block_h))](
        k, v, k_cache, v_cache, slot_mapping,
        k_scale if k_scale is not None else slot_mapping, v_scale if v_scale is not None else slot_mapping,
        num_kv_heads, k_cache.shape[1],
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4 if block_h * block_d >= 1024 else 2,
    )  # fmt: skip
