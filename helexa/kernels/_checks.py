"""Argument checks shared by the torch references and the Triton wrappers; each raises `ValueError`.

Shape, dtype and device checks read tensor metadata only. Checks of tensor values (slot and
block-id ranges, query lengths against context lengths, fp8 scales) copy to the host, so they run
only when `helexa.values.debug_enabled()`.

An fp8 KV cache (`FP8_KV_DTYPE`, e4m3) holds `x / scale` saturated to `±FP8_KV_MAX`; it comes with
`k_scale` and `v_scale`, each `(KVH,)` float32 (one scale per KV head) on the caches' device. A
cache of any other dtype takes no scales.

A 16-bit cache under float32 K/V and queries (`HALF_KV_DTYPES`, the CPU's 16-bit KV: `half_cache=True`,
which only the torch reference passes) stores each value rounded to the cache's dtype and is read
back widened; caches otherwise have the dtype of what they store.
"""

from __future__ import annotations

import torch

from helexa.values import debug_enabled

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_KV_DTYPE = torch.float8_e4m3fn  # `--kv-cache-dtype fp8`
FP8_KV_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448.0: larger magnitudes saturate to it
HALF_KV_DTYPES = (torch.float16, torch.bfloat16)  # 16-bit caches a float32 model may keep (`half_cache`)


def _cache_matches(cache: torch.dtype, values: torch.dtype, half_cache: bool) -> bool:
    """A cache of dtype `cache` may hold values of dtype `values` (fp8: checked with its scales)."""
    if cache in (values, FP8_KV_DTYPE):
        return True
    return half_cache and values == torch.float32 and cache in HALF_KV_DTYPES


def _shape(name: str, t: torch.Tensor, *dims: int | str) -> None:
    """`t` has one dimension per entry of `dims`, equal to it where it is an int (a str names a free one)."""
    if t.dim() != len(dims) or any(isinstance(d, int) and n != d for n, d in zip(t.shape, dims)):
        raise ValueError(f"{name} must be [{', '.join(map(str, dims))}], got {tuple(t.shape)}")


def _cache_shape(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    _shape("k_cache", k_cache, "num_blocks", "block_size", "num_kv_heads", "head_dim")
    _same("shape", "k_cache", k_cache, v_cache=v_cache)
    nb, bs, kvh, d = k_cache.shape
    return nb, bs, kvh, d


def _same(attr: str, ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    """Every tensor of `others` has `ref`'s `attr` ("shape", "dtype" or "device")."""
    want = getattr(ref, attr)
    for name, t in others.items():
        if getattr(t, attr) != want:
            got, exp = (tuple(t.shape), tuple(want)) if attr == "shape" else (getattr(t, attr), want)
            raise ValueError(f"{name} {attr} {got} != {ref_name} {attr} {exp}")


def _dtypes(allowed: tuple[torch.dtype, ...], dtype: torch.dtype, **index: torch.Tensor) -> None:
    """`dtype` is one of `allowed`; every tensor of `index` is int32 or int64."""
    if dtype not in allowed:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {allowed}")
    for name, t in index.items():
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


def check_write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    float_dtypes: tuple[torch.dtype, ...],
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    half_cache: bool = False,
) -> None:
    """k, v: (T, KVH, D); k_cache, v_cache: (NB, BS, KVH, D), one dtype out of `float_dtypes` (k's), or
    fp8 with k of a dtype out of `float_dtypes` and both scales, or (`half_cache`) 16-bit under float32
    k (see the module docstring);
    slot_mapping: (T,) int32/int64, all on k's device. Debug mode: every slot is -1 or in [0, NB*BS)."""
    num_blocks, block_size, num_kv_heads, head_dim = _cache_shape(k_cache, v_cache)
    _shape("k", k, "num_tokens", num_kv_heads, head_dim)
    _same("shape", "k", k, v=v)
    _shape("slot_mapping", slot_mapping, k.shape[0])
    _same("dtype", "k_cache", k_cache, v_cache=v_cache)
    _same("dtype", "k", k, v=v)
    if not _cache_matches(k_cache.dtype, k.dtype, half_cache):
        _same("dtype", "k_cache", k_cache, k=k)
    _dtypes(float_dtypes, k.dtype, slot_mapping=slot_mapping)
    _same("device", "k", k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_kv_scales(k_cache, k_scale, v_scale)
    if debug_enabled() and slot_mapping.numel() > 0:
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    half_cache: bool = False,
) -> None:
    """q: (T, H, D) of a dtype in `float_dtypes`; k_cache, v_cache: (NB, BS, KVH, D) of q's dtype, or
    fp8 with both scales, or (`half_cache`) 16-bit under float32 q (see the module docstring),
    H % KVH == 0; block_tables: (B, MB); seq_lens: (B,); query_start_loc: (B+1,); index tensors int32
    or int64; out: None or like q; all on q's device. Debug mode also checks values: query_start_loc
    rises from 0 to T, each query length <= its context length, and the block ids each sequence reads
    fit its table row and lie in [0, NB)."""
    num_blocks, block_size, num_kv_heads, head_dim = _cache_shape(k_cache, v_cache)
    _shape("q", q, "total_q_tokens", "num_heads", head_dim)
    total_q, num_heads, _ = q.shape
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
    _shape("block_tables", block_tables, "batch", "max_blocks")
    batch = block_tables.shape[0]
    _shape("seq_lens", seq_lens, batch)
    _shape("query_start_loc", query_start_loc, batch + 1)
    index = dict(block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc)
    _dtypes(float_dtypes, q.dtype, **index)
    _same("dtype", "k_cache", k_cache, v_cache=v_cache)
    if not _cache_matches(k_cache.dtype, q.dtype, half_cache):
        _same("dtype", "q", q, k_cache=k_cache)
    _same("device", "q", q, k_cache=k_cache, v_cache=v_cache, **index)
    check_kv_scales(k_cache, k_scale, v_scale)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        want, got = (tuple(q.shape), q.dtype, q.device), (tuple(out.shape), out.dtype, out.device)
        raise ValueError(f"out must match q {want}, got {got}")
    if debug_enabled() and batch > 0:
        qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
        if qsl[0] != 0 or qsl[-1] != total_q or any(b < a for a, b in zip(qsl, qsl[1:])):
            raise ValueError(f"query_start_loc must rise from 0 to {total_q}, got {qsl}")
        for b in range(batch):
            q_len, needed = qsl[b + 1] - qsl[b], -(-lens[b] // block_size)
            if q_len > lens[b]:
                raise ValueError(f"sequence {b}: {q_len} query tokens but seq_len {lens[b]}")
            if needed > block_tables.shape[1]:
                raise ValueError(
                    f"sequence {b}: seq_len {lens[b]} needs {needed} blocks, table has {block_tables.shape[1]}"
                )
            ids = block_tables[b, :needed]
            if needed and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
                raise ValueError(f"sequence {b}: block ids {ids.tolist()} outside [0, {num_blocks})")


def check_kv_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """An fp8 cache comes with `k_scale` and `v_scale`, each (KVH,) float32 on its device; any other
    cache with neither. Debug mode: every scale is finite and > 0."""
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if k_cache.dtype != FP8_KV_DTYPE:
        given = [name for name, t in scales.items() if t is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} apply to an fp8 ({FP8_KV_DTYPE}) cache, not {k_cache.dtype}")
        return
    missing = [name for name, t in scales.items() if t is None]
    if missing:
        raise ValueError(f"an fp8 ({FP8_KV_DTYPE}) cache needs {' and '.join(missing)}: (num_kv_heads,) float32")
    for name, t in scales.items():
        assert t is not None
        _shape(name, t, k_cache.shape[2])
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
        if t.device != k_cache.device:
            raise ValueError(f"{name} device {t.device} != k_cache device {k_cache.device}")
        if debug_enabled() and t.numel() > 0 and not bool(torch.isfinite(t).all() and (t > 0).all()):
            raise ValueError(f"{name} must be finite and > 0, got {t.tolist()}")
