"""The dense matmul of the model's linear layers on CUDA, in Triton, batch invariant: `dense_matmul_triton`.

y = x @ W.T for x (M, K) and W (N, K) of one float dtype (float32, float16, bfloat16), y (M, N) in that
dtype, accumulated in float32. `torch.nn.functional.linear` defines the result up to rounding.

Why not cuBLAS: its summation order for a row follows the shape of the whole product (the first run
on an H200 measured the MLP's down projection, K = 8192, changing its bits from M = 200 on), so a
token's logits would depend on what else shares its step. Here the launch configuration depends on
(N, K, dtype, the device's SM count) only, never on M (`dense_config`): every row is computed by
the same tile program, walking K in the same BLOCK_K steps, split at the same places, the splits
added in one fixed order. So a row's result is the same bits whatever the number of rows with it
(checked in the Triton interpreter by `tests/kernels/test_dense_matmul.py`, on a GPU by
`bench/gpu_invariance.py`).

Kernel: a program computes a (BLOCK_M, BLOCK_N) tile over its share of K; rows past M and columns
past N are clamped for loads and masked on the store; K needs no mask when BLOCK_K divides it, else
the last step is masked (any K). With SPLIT_K > 1 each split writes an fp32 partial and
`quant_matmul`'s split reduction adds them in split order (the same tiling and reduction as the
weight-only quantized matmuls).

Dispatch: `helexa.kernels.linear` runs it for CUDA tensors and `F.linear` elsewhere (CPU steps keep
torch's matmul and never import Triton; the kernel itself is tested on the CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helexa.kernels.quant_matmul import (
    _INTERPRETER_SMS,
    QuantMatmulConfig,
    _sm_count,
    _store_tile,
    _sum_splits,
    _tile,
    split_k,
)

__all__ = ["dense_config", "dense_matmul_triton"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _dense_step(
    acc, it, x_tile_ptrs, w_tile_ptrs, ks, K, stride_xk, stride_wk,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """acc += x[:, k0:k0+BK] @ W[cols, k0:k0+BK].T for k0 = it * BLOCK_K; columns past K read as 0.
    With EVEN_K (BLOCK_K | K) the loads are unmasked, which lets the compiler pipeline them (cp.async)."""
    k0 = it * BLOCK_K
    if EVEN_K:
        x = tl.load(x_tile_ptrs + k0 * stride_xk)  # (BM, BK)
        w = tl.load(w_tile_ptrs + k0 * stride_wk)  # (BK, BN)
    else:
        inside = (k0 + ks) < K  # (BK,)
        x = tl.load(x_tile_ptrs + k0 * stride_xk, mask=inside[None, :], other=0.0)
        w = tl.load(w_tile_ptrs + k0 * stride_wk, mask=inside[:, None], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(x, w, acc, input_precision=DOT_PRECISION)


@triton.jit
def _dense_matmul_kernel(
    x_ptr,  # (M, K)
    w_ptr,  # (N, K), x's dtype
    out_ptr,  # (M, N), x's dtype — written when not SPLIT
    part_ptr,  # (SPLIT_K, M, N) fp32, last dim contiguous — written when SPLIT
    M, N, K, num_iters, iters_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on, stride_ps, stride_pm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Program (pid_m, pid_n, pid_k): y tile rows [pid_m*BM, +BM) x cols [pid_n*BN, +BN) over K steps
    [pid_k * iters_per_split, min(+iters_per_split, num_iters))."""
    pid_k = tl.program_id(2)
    rows, cols, rows_ld, cols_ld = _tile(M, N, BLOCK_M, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)  # (BK,)
    x_tile_ptrs = x_ptr + rows_ld[:, None] * stride_xm + ks[None, :] * stride_xk  # (BM, BK)
    w_tile_ptrs = w_ptr + cols_ld[None, :] * stride_wn + ks[:, None] * stride_wk  # (BK, BN)
    it_lo = pid_k * iters_per_split
    it_hi = tl.minimum(it_lo + iters_per_split, num_iters)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRETED:  # numpy >= 2.4 cannot take the interpreter's 1-element tensors as range() bounds
        it = it_lo
        while it < it_hi:
            acc = _dense_step(acc, it, x_tile_ptrs, w_tile_ptrs, ks, K, stride_xk, stride_wk, BLOCK_K, EVEN_K,
                              UPCAST, DOT_PRECISION)  # fmt: skip
            it += 1
    else:
        for it in range(it_lo, it_hi):
            acc = _dense_step(acc, it, x_tile_ptrs, w_tile_ptrs, ks, K, stride_xk, stride_wk, BLOCK_K, EVEN_K,
                              UPCAST, DOT_PRECISION)  # fmt: skip
    _store_tile(acc, out_ptr, part_ptr, rows, cols, M, N, pid_k, stride_om, stride_on, stride_ps, stride_pm, SPLIT)


def dense_config(n: int, k: int, num_sms: int, dtype: torch.dtype = torch.bfloat16) -> QuantMatmulConfig:
    """The launch config of `dense_matmul_triton` for an (N, K) weight of `dtype` on a device with
    `num_sms` SMs. It does not depend on M, which is what makes the matmul batch invariant.

    fp16/bf16: 64 x 128 x 64 tiles, 4 warps, 4 stages (tensor cores; a decode row pads to 64 rows,
    compute the weight read hides). fp32 (exact "ieee" dot on the FMA units): 16 x 32 x 64, 4 warps,
    3 stages. K is split (`quant_matmul.split_k`) until the column tiles times the splits cover the
    SMs once, so that a decode step keeps enough of the weight read in flight."""
    if dtype == torch.float32:
        bm, bn, bk, warps, stages = 16, 32, 64, 4, 3
    else:
        bm, bn, bk, warps, stages = 64, 128, 64, 4, 4
    return QuantMatmulConfig(bm, bn, bk, split_k(triton.cdiv(n, bn), triton.cdiv(k, bk), num_sms, 1), warps, stages)


def _check(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be (M, K) and weight (N, K), got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in _FLOATS or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one of {_FLOATS}, got {x.dtype} and {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    m, n = x.shape[0], weight.shape[0]
    if out is not None and (out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device):
        want, got = ((m, n), x.dtype, x.device), (tuple(out.shape), out.dtype, out.device)
        raise ValueError(f"out must be {want}, got {got}")


def dense_matmul_triton(
    x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None, config: QuantMatmulConfig | None = None
) -> torch.Tensor:
    """y = x @ weight.T with the Triton kernel: x (M, K), weight (N, K) of the same float dtype, any
    strides. Returns (M, N) in x's dtype, accumulated in fp32, written into `out` when given (every
    element of it). `config` overrides `dense_config` (any power-of-two tiles >= 16 and BLOCK_K >= 16).
    Reads no tensor value on the host. Raises ValueError for bad shapes, dtypes or devices."""
    _check(x, weight, out)
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = x.new_empty((m, n))
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if config is None:
        sms = _sm_count(x.device.index or 0) if x.is_cuda else _INTERPRETER_SMS
        config = dense_config(n, k, sms, x.dtype)
    iters = triton.cdiv(k, config.block_k)
    per_split = triton.cdiv(iters, config.split_k)
    splits = triton.cdiv(iters, per_split)
    if splits > 1:
        part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    else:
        part = torch.empty((1, 1, 1), dtype=torch.float32, device=x.device)
    interpreted = not x.is_cuda
    upcast = interpreted and x.dtype == torch.bfloat16  # the interpreter's dot mishandles bf16 operands
    _dense_matmul_kernel[(triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), splits)](
        x, weight, out, part, m, n, k, iters, per_split,
        *x.stride(), *weight.stride(), *out.stride(), part.stride(0), part.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0,
        SPLIT=splits > 1, UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast or x.dtype == torch.float32 else "tf32", INTERPRETED=interpreted,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if splits > 1:
        _sum_splits(part, out, splits)
    return out
