"""Weight-only quantized matmuls in Triton: W8A16 (`int8_matmul`) and W4A16 (`int4_matmul`).

y = x @ W.T for activations x (M, K) in float32/float16/bfloat16 and a weight W (N, K) stored
quantized; y is (M, N) in x's dtype. The layouts (see `quant_reference`, which defines the result):

- int8, per output channel: qweight int8 (N, K), scales (N,);        W[n, k] = q[n, k] * s[n]
- int8, group-wise:         qweight int8 (N, K), scales (N, K // G);  W[n, k] = q[n, k] * s[n, k // G]
- int4, group-wise:         qweight uint8 (N, K // 2), low nibble = even k, high nibble = odd k,
                            q in [0, 15]; scales, zeros (N, K // G);
                            W[n, k] = (q[n, k] - 8) * s[n, k // G] + z[n, k // G]

with G % 32 == 0, G | K, K % 32 == 0; scales/zeros float32, float16 or bfloat16. Anything else
raises ValueError (`quant_reference.check_int8_matmul` / `check_int4_matmul`).

Kernel. A program computes a (BLOCK_M, BLOCK_N) tile of y over its share of K: it walks K in
BLOCK_K steps, loads the x tile and the packed weight tile as (BLOCK_K, BLOCK_N) ("K-major", so
`tl.dot(x, w)` needs no transpose), dequantizes the weight in registers in fp32 (int4: nibbles by
`& 0xF` / `>> 4`; then `q * s + (z - 8 s)`), casts it to x's dtype and accumulates `tl.dot` in fp32.
BLOCK_K is a power of two in [32, 256] that divides K and either divides G (one scale per column
per step) or is a multiple of G (BLOCK_K // G scale groups per step, broadcast through a reshape).
int8 per-channel scales are applied once to the fp32 accumulator instead (exact: |q| <= 128 is
representable in fp16/bf16). int4 never interleaves nibbles: the low-nibble tile (the even k) is
multiplied with the even columns of x and the high-nibble tile with the odd columns, two dots per
step. Rows past M and columns past N are clamped for loads (`% M`, `% N`, no load masks) and
masked on the store; K needs no mask (BLOCK_K | K).

Split-K (decode): with SPLIT_K > 1 the K steps are shared among SPLIT_K programs per tile; each
writes an fp32 partial (SPLIT_K, M, N) and `_sum_splits_kernel` adds them in a fixed order
(deterministic) into y. `choose_config` picks one tiling per weight, whatever M (batch invariant),
and splits K until the grid covers the SMs about twice. Offsets of weight rows and of y rows are
64-bit, so weights over 2^31 bytes work.

Dispatch: `int8_matmul` / `int4_matmul` run the Triton kernel for CUDA tensors or when
`TRITON_INTERPRET=1` (the CPU tests), else the torch reference. In the interpreter, bf16 inputs
are computed in fp32 (its dot mishandles bf16 operands; fp16/fp32 take the compiled path's casts),
and K is walked with a while loop (numpy >= 2.4 cannot use the interpreter's 1-element tensors as
range() bounds); compiled code keeps the pipelined for loop.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from helexa.kernels import quant_reference
from helexa.kernels.quant_reference import check_int4_matmul, check_int8_matmul

__all__ = [
    "QuantMatmulConfig",
    "choose_config",
    "split_k",
    "int4_matmul",
    "int4_matmul_triton",
    "int8_matmul",
    "int8_matmul_triton",
]

_MAX_SPLIT_K = 16
# SMs assumed where there is no device (the interpreter): small, so default configs split K in tests.
_INTERPRETER_SMS = 4


@dataclass(frozen=True)
class QuantMatmulConfig:
    """Launch configuration of a quantized matmul: tile sizes (powers of two; block_m, block_n >= 16;
    32 <= block_k <= 256, block_k | K and block_k | G or G | block_k), the number of K splits, and the
    compiler's num_warps / num_stages. Every valid config gives the same result up to fp32 rounding."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _dequant(
    q,  # (R, BLOCK_N) fp32 codes (already shifted for int4: q - 8 is folded into b)
    s,  # (GPT, BLOCK_N) fp32 scales of the GPT groups the R rows cover, R // GPT rows each
    b,  # (GPT, BLOCK_N) fp32 offsets (ignored unless HAS_B)
    R: tl.constexpr, BLOCK_N: tl.constexpr, GPT: tl.constexpr, HAS_B: tl.constexpr,
):  # fmt: skip
    """q * s (+ b), each row with the scale of its group -> (R, BLOCK_N) fp32."""
    if GPT == 1:
        w = q * s
        if HAS_B:
            w = w + b
    else:
        w3 = tl.reshape(q, (GPT, R // GPT, BLOCK_N)) * s[:, None, :]  # (GPT, R // GPT, BN)
        if HAS_B:
            w3 = w3 + b[:, None, :]
        w = tl.reshape(w3, (R, BLOCK_N))
    return w


@triton.jit
def _load_groups(
    col_ptrs,  # (BLOCK_N,) pointers to column 0 of the scale (or zero) rows of this tile
    g0, stride_g, GPT: tl.constexpr,
):  # fmt: skip
    """Groups g0 .. g0 + GPT - 1 of each row -> (GPT, BLOCK_N) fp32 ((1, BLOCK_N) when GPT == 1)."""
    if GPT == 1:
        v = tl.load(col_ptrs + g0 * stride_g)[None, :]
    else:
        groups = g0 + tl.arange(0, GPT)  # (GPT,)
        v = tl.load(col_ptrs[None, :] + groups[:, None] * stride_g)
    return v.to(tl.float32)


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (pid_m, pid_n, pid_k)'s output rows and columns, and the same clamped into y for loads
    (`% M`, `% N`: loads need no row or column mask; the store masks instead)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    return rows, cols, (rows % M).to(tl.int64), (cols % N).to(tl.int64)


@triton.jit
def _store_tile(
    acc,  # (BLOCK_M, BLOCK_N) fp32
    out_ptr, part_ptr, rows, cols, M, N, pid_k,
    stride_om, stride_on, stride_ps, stride_pm, SPLIT: tl.constexpr,
):  # fmt: skip
    """Write the tile into y (in y's dtype), or as split `pid_k`'s fp32 partial."""
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)[:, None]
    if SPLIT:
        dst = part_ptr + pid_k.to(tl.int64) * stride_ps + rows64 * stride_pm + cols[None, :]
        tl.store(dst, acc, mask=mask)
    else:
        dst = out_ptr + rows64 * stride_om + cols[None, :].to(tl.int64) * stride_on
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int8_step(
    acc,  # (BLOCK_M, BLOCK_N) fp32
    it, x_tile_ptrs, w_tile_ptrs, s_cols, stride_xk, stride_wk, stride_sg,
    GROUP: tl.constexpr, GPT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """acc += x[:, k0:k0+BK] @ W[cols, k0:k0+BK].T for k0 = it * BLOCK_K."""
    k0 = it * BLOCK_K
    x = tl.load(x_tile_ptrs + k0 * stride_xk)  # (BM, BK)
    q = tl.load(w_tile_ptrs + k0 * stride_wk)  # (BK, BN) int8
    if GROUP == 0:  # per-channel: the scale is applied to the accumulator at the end
        if UPCAST:
            w = q.to(tl.float32)
        else:
            w = q.to(x.dtype)  # exact: |q| <= 128
    else:
        s = _load_groups(s_cols, k0 // GROUP, stride_sg, GPT)  # (GPT, BN)
        w = _dequant(q.to(tl.float32), s, s, BLOCK_K, BLOCK_N, GPT, False)  # (BK, BN) fp32
        if not UPCAST:
            w = w.to(x.dtype)
    if UPCAST:
        x = x.to(tl.float32)
    return tl.dot(x, w, acc, input_precision=DOT_PRECISION)


@triton.jit
def _int8_matmul_kernel(
    x_ptr,  # (M, K) fp32/fp16/bf16
    w_ptr,  # (N, K) int8
    s_ptr,  # (N,) or (N, K // GROUP)
    out_ptr,  # (M, N), x's dtype — written when not SPLIT
    part_ptr,  # (SPLIT_K, M, N) fp32, last dim contiguous — written when SPLIT
    M, N, num_iters, iters_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg,
    stride_om, stride_on, stride_ps, stride_pm,
    GROUP: tl.constexpr,  # 0: per-channel scales
    GPT: tl.constexpr,  # scale groups per K step (BLOCK_K // GROUP, at least 1)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Program (pid_m, pid_n, pid_k): y tile rows [pid_m*BM, +BM) x cols [pid_n*BN, +BN) over K steps
    [pid_k * iters_per_split, min(+iters_per_split, num_iters))."""
    pid_k = tl.program_id(2)
    rows, cols, rows_ld, cols_ld = _tile(M, N, BLOCK_M, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)  # (BK,)
    x_tile_ptrs = x_ptr + rows_ld[:, None] * stride_xm + ks[None, :] * stride_xk  # (BM, BK)
    w_tile_ptrs = w_ptr + cols_ld[None, :] * stride_wn + ks[:, None] * stride_wk  # (BK, BN)
    s_cols = s_ptr + cols_ld * stride_sn  # (BN,)

    it_lo = pid_k * iters_per_split
    it_hi = tl.minimum(it_lo + iters_per_split, num_iters)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRETED:
        it = it_lo
        while it < it_hi:
            acc = _int8_step(acc, it, x_tile_ptrs, w_tile_ptrs, s_cols, stride_xk, stride_wk, stride_sg,
                GROUP, GPT, BLOCK_K, BLOCK_N, UPCAST, DOT_PRECISION)  # fmt: skip
            it += 1
    else:
        for it in range(it_lo, it_hi):
            acc = _int8_step(acc, it, x_tile_ptrs, w_tile_ptrs, s_cols, stride_xk, stride_wk, stride_sg,
                GROUP, GPT, BLOCK_K, BLOCK_N, UPCAST, DOT_PRECISION)  # fmt: skip
    if GROUP == 0:
        acc = acc * tl.load(s_cols).to(tl.float32)[None, :]
    _store_tile(acc, out_ptr, part_ptr, rows, cols, M, N, pid_k, stride_om, stride_on, stride_ps, stride_pm, SPLIT)


@triton.jit
def _int4_step(
    acc,  # (BLOCK_M, BLOCK_N) fp32
    it, x_even_ptrs, w_tile_ptrs, s_cols, z_cols, stride_xk, stride_wk, stride_sg, stride_zg,
    GROUP: tl.constexpr, GPT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """acc += x[:, k0:k0+BK] @ W[cols, k0:k0+BK].T for k0 = it * BLOCK_K, as even k + odd k."""
    HALF: tl.constexpr = BLOCK_K // 2
    k0 = it * BLOCK_K
    x_even = tl.load(x_even_ptrs + k0 * stride_xk)  # (BM, BK/2): columns k0, k0+2, ...
    x_odd = tl.load(x_even_ptrs + (k0 + 1) * stride_xk)  # (BM, BK/2): columns k0+1, k0+3, ...
    packed = tl.load(w_tile_ptrs + (k0 // 2) * stride_wk)  # (BK/2, BN) uint8
    q_even = (packed & 0xF).to(tl.float32)  # (BK/2, BN) low nibbles: even k
    q_odd = (packed >> 4).to(tl.float32)  # (BK/2, BN) high nibbles: odd k
    g0 = k0 // GROUP
    s = _load_groups(s_cols, g0, stride_sg, GPT)  # (GPT, BN)
    b = _load_groups(z_cols, g0, stride_zg, GPT) - 8.0 * s  # (GPT, BN): (q - 8) s + z = q s + (z - 8 s)
    w_even = _dequant(q_even, s, b, HALF, BLOCK_N, GPT, True)  # (BK/2, BN) fp32
    w_odd = _dequant(q_odd, s, b, HALF, BLOCK_N, GPT, True)
    if UPCAST:
        x_even = x_even.to(tl.float32)
        x_odd = x_odd.to(tl.float32)
    else:
        w_even = w_even.to(x_even.dtype)
        w_odd = w_odd.to(x_even.dtype)
    acc = tl.dot(x_even, w_even, acc, input_precision=DOT_PRECISION)
    return tl.dot(x_odd, w_odd, acc, input_precision=DOT_PRECISION)


@triton.jit
def _int4_matmul_kernel(
    x_ptr,  # (M, K) fp32/fp16/bf16
    w_ptr,  # (N, K // 2) uint8, two 4-bit codes per byte
    s_ptr, z_ptr,  # (N, K // GROUP) each
    out_ptr,  # (M, N), x's dtype — written when not SPLIT
    part_ptr,  # (SPLIT_K, M, N) fp32, last dim contiguous — written when SPLIT
    M, N, num_iters, iters_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg,
    stride_om, stride_on, stride_ps, stride_pm,
    GROUP: tl.constexpr, GPT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """As `_int8_matmul_kernel`, for the packed int4 layout with zeros."""
    pid_k = tl.program_id(2)
    rows, cols, rows_ld, cols_ld = _tile(M, N, BLOCK_M, BLOCK_N)
    js = tl.arange(0, BLOCK_K // 2)  # (BK/2,) byte columns of a step
    x_even_ptrs = x_ptr + rows_ld[:, None] * stride_xm + (2 * js)[None, :] * stride_xk  # (BM, BK/2)
    w_tile_ptrs = w_ptr + cols_ld[None, :] * stride_wn + js[:, None] * stride_wk  # (BK/2, BN)
    s_cols = s_ptr + cols_ld * stride_sn  # (BN,)
    z_cols = z_ptr + cols_ld * stride_zn  # (BN,)

    it_lo = pid_k * iters_per_split
    it_hi = tl.minimum(it_lo + iters_per_split, num_iters)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRETED:
        it = it_lo
        while it < it_hi:
            acc = _int4_step(acc, it, x_even_ptrs, w_tile_ptrs, s_cols, z_cols, stride_xk, stride_wk, stride_sg,
                stride_zg, GROUP, GPT, BLOCK_K, BLOCK_N, UPCAST, DOT_PRECISION)  # fmt: skip
            it += 1
    else:
        for it in range(it_lo, it_hi):
            acc = _int4_step(acc, it, x_even_ptrs, w_tile_ptrs, s_cols, z_cols, stride_xk, stride_wk, stride_sg,
                stride_zg, GROUP, GPT, BLOCK_K, BLOCK_N, UPCAST, DOT_PRECISION)  # fmt: skip
    _store_tile(acc, out_ptr, part_ptr, rows, cols, M, N, pid_k, stride_om, stride_on, stride_ps, stride_pm, SPLIT)


@triton.jit
def _sum_splits_kernel(
    part_ptr,  # (SPLIT_K, M, N) fp32, last dim contiguous
    out_ptr,  # (M, N)
    N, num_splits, stride_ps, stride_pm, stride_om, stride_on,
    SPLITS_PAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """y[row, cols] = sum over splits of the partials, in split order, cast to y's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    splits = tl.arange(0, SPLITS_PAD)  # (S,)
    col_mask = cols < N
    mask = (splits[:, None] < num_splits) & col_mask[None, :]  # (S, BLOCK)
    parts = tl.load(part_ptr + splits[:, None].to(tl.int64) * stride_ps + row * stride_pm + cols[None, :], mask=mask,
        other=0.0)  # fmt: skip
    y = tl.sum(parts, 0)  # (BLOCK,)
    tl.store(out_ptr + row * stride_om + cols.to(tl.int64) * stride_on, y.to(out_ptr.dtype.element_ty), mask=col_mask)


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _block_k(k: int, group: int, cap: int) -> int:
    """Largest power of two in [32, cap] dividing K that divides G or is a multiple of it (G = 0:
    per-channel, no constraint); 32 always qualifies for valid shapes."""
    bk = cap
    while bk > 32 and (k % bk or (group and group % bk and bk % group)):
        bk //= 2
    return bk


def choose_config(n: int, k: int, group: int, num_sms: int, dtype: torch.dtype = torch.bfloat16) -> QuantMatmulConfig:
    """The launch config `int8_matmul_triton` / `int4_matmul_triton` use by default for an (N, K) weight
    with group size `group` (0 for int8 per-channel) and activations of `dtype` on a device with
    `num_sms` SMs. It does not depend on M: every row is computed by the same tile program over the same
    K steps and splits whatever the number of rows, so the matmul is batch invariant (a token's result
    never depends on what else shares its step; the first GPU run found rows changing from M = 64 on
    when the tiles followed M).

    fp16/bf16 (tensor cores): 16 x 64 tiles, BLOCK_K up to 128 (long contiguous weight rows per step),
    4 warps, 4 stages, the decode shape, which is bound by the weight read. fp32 (exact "ieee" dot on
    the FMA units, whose operands live in registers): 16 x 32 x 64. K is split into a power of two of
    parts (`split_k`) until the column tiles times the splits give about two programs per SM: enough
    loads in flight."""
    if dtype == torch.float32:
        bm, bn, bk, warps, stages = 16, 32, _block_k(k, group, 64), 4, 3
    else:
        bm, bn, bk, warps, stages = 16, 64, _block_k(k, group, 128), 4, 4
    return QuantMatmulConfig(bm, bn, bk, split_k(triton.cdiv(n, bn), k // bk, num_sms, 2), warps, stages)


def split_k(col_tiles: int, iters: int, num_sms: int, per_sm: int) -> int:
    """How many parts to split K's `iters` steps into when `col_tiles` column tiles give fewer programs
    than SMs: about `per_sm` programs per SM, a power of two (uneven splits, 5 of 32 steps, measured
    2.5x slower than 2 or 8 on an H200), at most 16, each part non-empty; else 1. It never depends on M,
    which keeps the matmuls batch invariant."""
    col_tiles, iters = max(1, col_tiles), max(1, iters)
    if col_tiles >= num_sms:
        return 1
    want = max(1, min(_MAX_SPLIT_K, iters, math.ceil(per_sm * num_sms / col_tiles)))
    split = 1 << (want.bit_length() - 1)
    return triton.cdiv(iters, triton.cdiv(iters, split))  # every split gets >= 1 step


def _check_config(cfg: QuantMatmulConfig, k: int, group: int) -> None:
    def pow2(v: int) -> bool:
        return v > 0 and v & (v - 1) == 0

    if not (pow2(cfg.block_m) and pow2(cfg.block_n) and cfg.block_m >= 16 and cfg.block_n >= 16):
        raise ValueError(f"block_m, block_n must be powers of two >= 16, got {cfg}")
    bk = cfg.block_k
    if not (pow2(bk) and 32 <= bk <= 256) or k % bk:
        raise ValueError(f"block_k must be a power of two in [32, 256] dividing K = {k}, got {bk}")
    if group and group % bk and bk % group:
        raise ValueError(f"block_k {bk} must divide the group size {group} or be a multiple of it")
    if cfg.split_k < 1 or cfg.num_warps < 1 or cfg.num_stages < 1:
        raise ValueError(f"split_k, num_warps and num_stages must be >= 1, got {cfg}")


def _prepare(
    x: torch.Tensor, n: int, group: int, out: torch.Tensor | None, config: QuantMatmulConfig | None
) -> tuple[torch.Tensor, QuantMatmulConfig, torch.Tensor]:
    """The output (given or new), the config (checked), and the fp32 split partials (a dummy when
    not split)."""
    m, k = x.shape
    if out is None:
        out = x.new_empty((m, n))
    elif out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device:
        want, got = ((m, n), x.dtype, x.device), (tuple(out.shape), out.dtype, out.device)
        raise ValueError(f"out must be {want}, got {got}")
    if config is None:
        sms = _sm_count(x.device.index or 0) if x.is_cuda else _INTERPRETER_SMS
        config = choose_config(n, k, group, sms, x.dtype)
    _check_config(config, k, group)
    if config.split_k > 1 and m and n:
        part = torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device)
    else:
        part = torch.empty((1, 1, 1), dtype=torch.float32, device=x.device)
    return out, config, part


def _common_meta(x: torch.Tensor, cfg: QuantMatmulConfig, group: int, splits: int) -> dict[str, object]:
    """Compile-time arguments shared by both kernels; `splits` is the number actually launched."""
    interpreted = not x.is_cuda
    gpt = max(1, cfg.block_k // group) if group else 1
    # The interpreter's dot multiplies bf16 operands as raw bits: upcast them there (fp16/fp32 take
    # the compiled path's casts, so the CPU tests exercise it).
    upcast = interpreted and x.dtype == torch.bfloat16
    return dict(
        GROUP=group, GPT=gpt, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=splits > 1,
        UPCAST=upcast, DOT_PRECISION="ieee" if upcast or x.dtype == torch.float32 else "tf32",
        INTERPRETED=interpreted, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _split_plan(k: int, cfg: QuantMatmulConfig) -> tuple[int, int, int]:
    """(K steps, steps per split, splits actually launched): no split is left without a step."""
    iters = k // cfg.block_k
    per_split = triton.cdiv(iters, cfg.split_k)
    return iters, per_split, triton.cdiv(iters, per_split)


def _sum_splits(part: torch.Tensor, out: torch.Tensor, splits: int) -> None:
    m, n = out.shape
    pad = triton.next_power_of_2(splits)
    block = max(32, min(triton.next_power_of_2(n), 4096 // pad))
    _sum_splits_kernel[(m, triton.cdiv(n, block))](
        part, out, n, splits, part.stride(0), part.stride(1), *out.stride(), SPLITS_PAD=pad, BLOCK=block, num_warps=4
    )


# ---------------------------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------------------------
def int8_matmul_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    config: QuantMatmulConfig | None = None,
) -> torch.Tensor:
    """y = x @ W.T with the Triton kernel, W the int8 weight dequantized per channel (scales (N,)) or
    per group (scales (N, K // G)); `quant_reference.int8_matmul_reference` defines the result.

    x (M, K) float32/float16/bfloat16, any strides; qweight int8 (N, K); K % 32 == 0, G % 32 == 0.
    Returns (M, N) in x's dtype, accumulated in fp32, written into `out` when given (every element
    of it). `config` overrides `choose_config`. Reads no tensor value on the host. Raises
    ValueError for bad shapes, dtypes, devices or configs."""
    group = check_int8_matmul(x, qweight, scales)
    m, k = x.shape
    n = qweight.shape[0]
    out, cfg, part = _prepare(x, n, group, out, config)
    if m == 0 or n == 0:
        return out
    iters, per_split, splits = _split_plan(k, cfg)
    stride_sg = scales.stride(1) if scales.dim() == 2 else 0
    _int8_matmul_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)](
        x, qweight, scales, out, part, m, n, iters, per_split,
        *x.stride(), *qweight.stride(), scales.stride(0), stride_sg, *out.stride(), part.stride(0), part.stride(1),
        **_common_meta(x, cfg, group, splits),
    )  # fmt: skip
    if splits > 1:
        _sum_splits(part, out, splits)
    return out


def int4_matmul_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    config: QuantMatmulConfig | None = None,
) -> torch.Tensor:
    """y = x @ W.T with the Triton kernel, W[n, k] = (q[n, k] - 8) * scales[n, k // G] + zeros[n, k // G]
    from the packed int4 qweight (N, K // 2) (low nibble = even k); `quant_reference.int4_matmul_reference`
    defines the result.

    x (M, K) float32/float16/bfloat16, any strides; scales, zeros (N, K // G); K % 32 == 0,
    G % 32 == 0. Returns (M, N) in x's dtype, accumulated in fp32, written into `out` when given
    (every element of it). `config` overrides `choose_config`. Reads no tensor value on the host.
    Raises ValueError for bad shapes, dtypes, devices or configs."""
    group = check_int4_matmul(x, qweight, scales, zeros)
    m, k = x.shape
    n = qweight.shape[0]
    out, cfg, part = _prepare(x, n, group, out, config)
    if m == 0 or n == 0:
        return out
    iters, per_split, splits = _split_plan(k, cfg)
    _int4_matmul_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)](
        x, qweight, scales, zeros, out, part, m, n, iters, per_split,
        *x.stride(), *qweight.stride(), *scales.stride(), *zeros.stride(), *out.stride(),
        part.stride(0), part.stride(1), **_common_meta(x, cfg, group, splits),
    )  # fmt: skip
    if splits > 1:
        _sum_splits(part, out, splits)
    return out


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def int8_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x @ W.T (M, N) in x's dtype for the int8 weight (per-channel (N,) or group-wise (N, K // G)
    scales): the Triton kernel for CUDA tensors or under TRITON_INTERPRET=1, else the torch reference.
    Written into `out` when given. Raises ValueError for arguments outside the contract."""
    if _use_triton(x):
        return int8_matmul_triton(x, qweight, scales, out=out)
    y = quant_reference.int8_matmul_reference(x, qweight, scales)
    return y if out is None else _copy_out(out, y)


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T (M, N) in x's dtype for the packed int4 weight with group scales and zeros: the
    Triton kernel for CUDA tensors or under TRITON_INTERPRET=1, else the torch reference. Written
    into `out` when given. Raises ValueError for arguments outside the contract."""
    if _use_triton(x):
        return int4_matmul_triton(x, qweight, scales, zeros, out=out)
    y = quant_reference.int4_matmul_reference(x, qweight, scales, zeros)
    return y if out is None else _copy_out(out, y)


def _copy_out(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if out.shape != y.shape or out.dtype != y.dtype or out.device != y.device:
        want, got = (tuple(y.shape), y.dtype, y.device), (tuple(out.shape), out.dtype, out.device)
        raise ValueError(f"out must be {want}, got {got}")
    return out.copy_(y)
