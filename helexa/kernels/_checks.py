"""Argument checks shared by the reference and the Triton wrappers of every kernel.

Shape, dtype and device checks read only tensor metadata (no device synchronisation). Checks that
must read tensor *values* (slot and block-id ranges, query lengths against context lengths) copy
to the host, so they run only when `HELEXA_DEBUG=1`.
"""

from __future__ import annotations

import os

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def debug_enabled() -> bool:
    """True when `HELEXA_DEBUG=1`: value checks that synchronise with the device are on."""
    return os.environ.get("HELEXA_DEBUG", "0") not in ("", "0")


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    float_dtypes: tuple[torch.dtype, ...],
) -> None:
    """Raise `ValueError` unless the `write_kv` arguments have consistent shapes, dtypes, devices.

    k, v: (T, KVH, D); k_cache, v_cache: (NB, BS, KVH, D); slot_mapping: (T,) int32/int64.
    """
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {_shape(k_cache)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {_shape(v_cache)} != k_cache shape {_shape(k_cache)}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if k.dim() != 3 or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"k must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, got {_shape(k)}"
        )
    if v.shape != k.shape:
        raise ValueError(f"v shape {_shape(v)} != k shape {_shape(k)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {_shape(slot_mapping)}")
    if slot_mapping.dtype not in INDEX_DTYPES:
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    for name, t in (("k", k), ("v", v), ("v_cache", v_cache)):
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != k_cache dtype {k_cache.dtype}")
    if k_cache.dtype not in float_dtypes:
        raise ValueError(f"unsupported dtype {k_cache.dtype}; expected one of {float_dtypes}")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device} but k is on {k.device}")
    if debug_enabled() and slot_mapping.numel() > 0:
        hi = int(slot_mapping.max())
        lo = int(slot_mapping.min())
        if lo < -1 or hi >= num_blocks * block_size:
            raise ValueError(
                f"slot_mapping values must be -1 or in [0, {num_blocks * block_size}), got range [{lo}, {hi}]"
            )


def check_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor | None,
    float_dtypes: tuple[torch.dtype, ...],
) -> None:
    """Raise `ValueError` unless the `paged_attention` arguments are consistent.

    q: (T, H, D); k_cache, v_cache: (NB, BS, KVH, D) with H % KVH == 0; block_tables: (B, MB);
    seq_lens: (B,); query_start_loc: (B+1,); index tensors int32 or int64; out: like q or None.
    With `HELEXA_DEBUG=1` also checks values: query_start_loc starts at 0, is non-decreasing and
    ends at T; each query length <= its context length; every block id a sequence reads is in
    range and its context fits its block-table row.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [total_q_tokens, num_heads, head_dim], got {_shape(q)}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {_shape(k_cache)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {_shape(v_cache)} != k_cache shape {_shape(k_cache)}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    total_q, num_heads, q_head_dim = q.shape
    if q_head_dim != head_dim:
        raise ValueError(f"q head_dim {q_head_dim} != cache head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
    if q.dtype not in float_dtypes:
        raise ValueError(f"unsupported dtype {q.dtype}; expected one of {float_dtypes}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != q dtype {q.dtype}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [batch, max_blocks], got {_shape(block_tables)}")
    batch = block_tables.shape[0]
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must be [{batch}] (one per block-table row), got {_shape(seq_lens)}")
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != batch + 1:
        raise ValueError(f"query_start_loc must be [{batch + 1}], got {_shape(query_start_loc)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    for name, t in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"out must match q ({_shape(q)}, {q.dtype}, {q.device}), "
                f"got ({_shape(out)}, {out.dtype}, {out.device})"
            )
    if debug_enabled() and batch > 0:
        qsl = query_start_loc.tolist()
        lens = seq_lens.tolist()
        if qsl[0] != 0 or qsl[-1] != total_q or any(b < a for a, b in zip(qsl, qsl[1:])):
            raise ValueError(f"query_start_loc must rise from 0 to {total_q}, got {qsl}")
        max_blocks = block_tables.shape[1]
        for b in range(batch):
            q_len = qsl[b + 1] - qsl[b]
            if q_len > lens[b]:
                raise ValueError(f"sequence {b}: {q_len} query tokens but seq_len {lens[b]}")
            needed = -(-lens[b] // block_size)
            if needed > max_blocks:
                raise ValueError(f"sequence {b}: seq_len {lens[b]} needs {needed} blocks, table has {max_blocks}")
            if needed:
                ids = block_tables[b, :needed]
                if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
                    raise ValueError(f"sequence {b}: block ids {ids.tolist()} outside [0, {num_blocks})")
