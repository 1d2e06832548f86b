"""helexa.kernels: Triton kernels for the paged KV cache and their pure-torch references.

Public kernels (SPEC.md, Kernels) pick their implementation per call from the tensors' device:
compiled Triton on CUDA; on CPU the torch reference, unless `TRITON_INTERPRET=1` is set, in which
case the Triton kernel runs in Triton's interpreter (how the tests exercise the kernels on CPU).

Modules:
  reference        pure-torch `write_kv`, `paged_attention`: the oracle and the CPU path
  write_kv         `write_kv_triton`: scatter new K/V rows into their cache slots
  paged_attention  `paged_attention_triton`: varlen causal attention over block tables
  block_alloc      allocator kernels (pop/push of the device-side free stack) — written with kvcache

Callers that choose a backend once (`--attention-backend`) use `get_attention_backend(name)`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from helexa.kernels import reference

__all__ = [
    "AttentionBackend",
    "get_attention_backend",
    "paged_attention",
    "paged_attention_triton",
    "reference",
    "write_kv",
    "write_kv_triton",
]


try:
    # Import the kernel modules before the dispatchers below are defined: importing a submodule
    # binds its name on this package, and the public functions `write_kv`/`paged_attention` must
    # win. (Use `from helexa.kernels.paged_attention import ...` to reach the module.)
    from helexa.kernels.paged_attention import paged_attention_triton
    from helexa.kernels.write_kv import write_kv_triton
except ModuleNotFoundError as exc:  # triton is a Linux-only dependency
    if exc.name != "triton":
        raise
    _TRITON_MISSING = f"the Triton kernels need the `triton` package ({exc}); use attention backend 'torch'"

    def write_kv_triton(*args, **kwargs) -> None:  # type: ignore[misc]
        """Stand-in when triton is not installed: raises RuntimeError."""
        raise RuntimeError(_TRITON_MISSING)

    def paged_attention_triton(*args, **kwargs) -> torch.Tensor:  # type: ignore[misc]
        """Stand-in when triton is not installed: raises RuntimeError."""
        raise RuntimeError(_TRITON_MISSING)


def _use_triton(t: torch.Tensor) -> bool:
    """Triton for CUDA tensors, and for CPU tensors when the Triton interpreter is on."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V rows into their cache slots in place (slot -1 skipped); see `reference.write_kv`.

    k, v: (T, KVH, D); k_cache, v_cache: (NB, BS, KVH, D); slot_mapping: (T,) int.
    """
    impl = write_kv_triton if _use_triton(k) else reference.write_kv
    impl(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention over the paged KV cache; see `reference.paged_attention`.

    q: (T, H, D); k_cache, v_cache: (NB, BS, KVH, D); block_tables: (B, MB) int32;
    seq_lens: (B,) int32; query_start_loc: (B+1,) int32. Returns (T, H, D) in q's dtype.
    """
    impl = paged_attention_triton if _use_triton(q) else reference.paged_attention
    return impl(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale, out=out)


@dataclass(frozen=True)
class AttentionBackend:
    """The pair of attention kernels a model binds once at construction.

    `write_kv` and `paged_attention` have the SPEC signatures; `name` is "auto", "triton" or "torch".
    """

    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


def get_attention_backend(name: str) -> AttentionBackend:
    """The kernels for `--attention-backend NAME`.

    "auto": per-call dispatch by device (Triton on CUDA or under TRITON_INTERPRET=1, else torch);
    "triton": always the Triton kernels; "torch": always the pure-torch references.
    Raises ValueError for any other name.
    """
    if name == "auto":
        return AttentionBackend("auto", write_kv, paged_attention)
    if name == "triton":
        return AttentionBackend("triton", write_kv_triton, paged_attention_triton)
    if name == "torch":
        return AttentionBackend("torch", reference.write_kv, reference.paged_attention)
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'triton' or 'torch'")
