"""helexa.kernels: Triton kernels for the paged KV cache and their pure-torch references.

`write_kv` and `paged_attention` pick their implementation per call from the tensors' device: the
compiled Triton kernel on CUDA; on CPU the torch reference, or the Triton kernel in Triton's
interpreter when `TRITON_INTERPRET=1` (how the tests run the kernels on CPU). Callers that choose
once (`--attention-backend`) use `get_attention_backend(name)`. Triton itself is imported only when
a Triton kernel is first used, so a CPU engine never loads it.

fp8 KV caches (`FP8_KV_DTYPE`, e4m3; `--kv-cache-dtype fp8`) take keyword-only `k_scale` and
`v_scale`, (KVH,) float32 each: `write_kv` stores `x / scale` saturated to ±448 and
`paged_attention` reads `cache * scale` (`reference.quantize_fp8`, `reference.dequantize_fp8`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from helexa.kernels import reference
from helexa.kernels._checks import FP8_KV_DTYPE, FP8_KV_MAX

__all__ = [
    "FP8_KV_DTYPE",
    "FP8_KV_MAX",
    "AttentionBackend",
    "get_attention_backend",
    "linear",
    "paged_attention",
    "paged_attention_triton",
    "reference",
    "write_kv",
    "write_kv_triton",
]

_TRITON_KERNELS = ("paged_attention_triton", "write_kv_triton", "dense_matmul_triton")


@functools.cache
def _triton_kernel(name: str) -> Callable[..., Any]:
    """The Triton kernel `name` (of _TRITON_KERNELS), its module imported on first use, so that a CPU
    process that never runs one never loads Triton (~50 MiB resident). Without the `triton` package it
    is a stand-in that raises RuntimeError saying so."""
    try:
        if name == "write_kv_triton":
            from helexa.kernels.kv_write import write_kv_triton

            return write_kv_triton
        if name == "dense_matmul_triton":
            from helexa.kernels.dense_matmul import dense_matmul_triton

            return dense_matmul_triton
        from helexa.kernels.attention import paged_attention_triton

        return paged_attention_triton
    except ModuleNotFoundError as exc:  # triton is a Linux-only dependency
        if exc.name != "triton":
            raise
        why = f"the Triton kernels need the `triton` package ({exc}); use attention backend 'torch'"

    def triton_missing(*args: object, **kwargs: object) -> Any:
        raise RuntimeError(why)

    return triton_missing


def __getattr__(name: str) -> Any:
    """`helexa.kernels.paged_attention_triton`, `.write_kv_triton` and `.dense_matmul_triton`, imported when
    first asked for."""
    if name in _TRITON_KERNELS:
        return _triton_kernel(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x (..., K), weight (N, K). On CUDA through the batch-invariant Triton
    matmul (`dense_matmul_triton`: a row's result never depends on how many rows share the product; the
    bias added after, in x's dtype); elsewhere `F.linear` itself, bit for bit."""
    if not x.is_cuda:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    y = _triton_kernel("dense_matmul_triton")(rows, weight).reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter new K/V rows into their cache slots in place (slot -1 skipped); see `reference.write_kv`.

    k, v: (T, KVH, D); k_cache, v_cache: (NB, BS, KVH, D); slot_mapping: (T,) int32/int64;
    k_scale, v_scale: (KVH,) float32 for fp8 caches only.
    """
    impl = _triton_kernel("write_kv_triton") if _use_triton(k) else reference.write_kv
    impl(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention over the paged KV cache; see `reference.paged_attention`.

    q: (T, H, D); k_cache, v_cache: (NB, BS, KVH, D); block_tables: (B, MB); seq_lens: (B,);
    query_start_loc: (B+1,); index tensors int32/int64; k_scale, v_scale: (KVH,) float32 for fp8
    caches only. Returns (T, H, D) in q's dtype.
    """
    impl = _triton_kernel("paged_attention_triton") if _use_triton(q) else reference.paged_attention
    return impl(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale, out=out,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


@dataclass(frozen=True)
class AttentionBackend:
    """The pair of attention kernels a model binds once; `name` is "auto", "triton" or "torch"."""

    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


def get_attention_backend(name: str) -> AttentionBackend:
    """The kernels for `--attention-backend NAME`: "auto" (per-call dispatch, as `write_kv` and
    `paged_attention` above), "triton" (always the Triton kernels) or "torch" (always the references).
    Raises ValueError for any other name."""
    if name == "auto":
        return AttentionBackend("auto", write_kv, paged_attention)
    if name == "triton":
        return AttentionBackend("triton", _triton_kernel("write_kv_triton"), _triton_kernel("paged_attention_triton"))
    if name == "torch":
        return AttentionBackend("torch", reference.write_kv, reference.paged_attention)
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'triton' or 'torch'")
