"""Triton `paged_attention`: varlen causal attention over the paged KV cache (decode, prefill, extend).

A program handles one (query tile, KV head, split): up to `BLOCK_Q` queries of one sequence times
the `GROUP` query heads of the KV head (`BLOCK_M = BLOCK_Q * GROUP` rows), so a K/V tile is read
once per GQA group. It finds its sequence by binary search over `query_start_loc` (no host copy at
launch) and walks the keys in tiles of `TILE_N` positions through the block table, with an online
base-2 softmax in fp32. Offsets are 64-bit, so pools over 2^31 elements work.

Batch invariance: a query's result does not depend on the batch, on its place in a query tile or on
how its sequence was split into steps. Its keys are split at fixed positions, every `split_keys`
keys from position 0 (never a count sized against the batch or the SMs); each split is one online
softmax over its tiles in order, giving a partial (running max, sum, unnormalised output), and the
partials are folded in split order by `_fold`. A decode-like batch (one query per sequence) runs its
splits as parallel programs (flash-decoding) and folds them in `_reduce_splits_kernel`; any other
batch folds them in the program's own loop: the same arithmetic either way. The tile shapes
(`BLOCK_M`, `TILE_N`) depend on the GQA group and head size only, never on the batch, and tiles past
a query's position are exact no-ops for it (its scores there are -inf: scale 1, add 0).

fp8 (e4m3) caches are converted on load to q's dtype (exact: every e4m3 value is a bf16, fp16 and
fp32 value); the KV head's `k_scale` is folded into the softmax scale and its `v_scale` multiplies
the output, so the dot products run at q's precision, as for an unquantized cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helexa.kernels._checks import TRITON_DTYPES, check_paged_attention

__all__ = ["SPLIT_KEYS", "paged_attention_triton"]

_LOG2E = 1.4426950408889634
_EMPTY = tl.constexpr(-1.0e30)  # the running max before any key (finite, so an empty row stays NaN-free)
SPLIT_KEYS = 512  # keys per split: a query's keys are split at multiples of this, whatever the batch


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile_idx, BLOCK_Q: tl.constexpr):
    """Largest b with query_start_loc[b] // BLOCK_Q + b <= tile_idx (the first tile of sequence b)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _fold(m_run, l_run, o_run, m, l_sum, acc):
    """Fold one split's partial (m, l_sum, acc) into the running (m_run, l_run, o_run) of the splits
    before it: the one merge, in the attention program's own loop and in `_reduce_splits_kernel`
    alike. The running state starts at (_EMPTY, 0, 0); an empty split (m = _EMPTY, l_sum = 0,
    acc = 0) leaves it unchanged."""
    m_new = tl.maximum(m_run, m)
    a = tl.exp2(m_run - m_new)
    b = tl.exp2(m - m_new)
    return m_new, l_run * a + l_sum * b, o_run * a[:, None] + acc * b[:, None]


@triton.jit
def _attend_tile(
    tile, acc, l_i, m_i,
    q,  # (M, D)
    q_pos,  # (M,)
    kv_len, table_row, k_head, v_head, dims64, d_valid,
    block_size, qk_scale, stride_btn, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
    TILE_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over key positions [tile * TILE_N, (tile + 1) * TILE_N)."""
    pos = tile * TILE_N + tl.arange(0, TILE_N)  # (N,) key positions
    k_valid = pos < kv_len
    block = tl.load(table_row + (pos // block_size) * stride_btn, mask=k_valid, other=0).to(tl.int64)
    row = (pos % block_size).to(tl.int64)
    kv_mask = k_valid[:, None] & d_valid[None, :]  # (N, D)
    k_offs = block[:, None] * stride_kb + row[:, None] * stride_ks + dims64[None, :] * stride_kd  # (N, D)
    v_offs = block[:, None] * stride_vb + row[:, None] * stride_vs + dims64[None, :] * stride_vd  # (N, D)
    k = tl.load(k_head + k_offs, mask=kv_mask, other=0.0)  # (N, D)
    v = tl.load(v_head + v_offs, mask=kv_mask, other=0.0)  # (N, D)
    if KV_FP8:  # e4m3 -> q's dtype, exact; the scales are applied outside (qk_scale, output)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    elif UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (M, N)
    visible = (pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # (M,)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # (M, N)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_split(
    split, tiles_per_split, num_tiles, q, q_pos, kv_len, table_row, k_head, v_head, dims64, d_valid,
    block_size, qk_scale, stride_btn, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """One split's partial: an online softmax over its tiles [split * tiles_per_split, ...), in order,
    from (_EMPTY, 0, 0). Returns (m, l, acc) unnormalised."""
    m_i = tl.full([BLOCK_M], _EMPTY, tl.float32)  # running max (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    # NumPy >= 2.4 cannot turn the interpreter's 1-element tensors into range() bounds, so the
    # interpreter walks the tiles with a while loop; compiled code keeps the pipelined for loop.
    if INTERPRETED:
        tile = tile_lo
        while tile < tile_hi:
            acc, l_i, m_i = _attend_tile(tile, acc, l_i, m_i, q, q_pos, kv_len, table_row, k_head, v_head, dims64,
                d_valid, block_size, qk_scale, stride_btn, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs,
                stride_vd, TILE_N, UPCAST, DOT_PRECISION, KV_FP8)  # fmt: skip
            tile += 1
    else:
        for tile in range(tile_lo, tile_hi):
            acc, l_i, m_i = _attend_tile(tile, acc, l_i, m_i, q, q_pos, kv_len, table_row, k_head, v_head, dims64,
                d_valid, block_size, qk_scale, stride_btn, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs,
                stride_vd, TILE_N, UPCAST, DOT_PRECISION, KV_FP8)  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _attention_kernel(
    q_ptr,  # (T, H, D)
    k_cache_ptr, v_cache_ptr,  # (NB, BS, KVH, D)
    block_tables_ptr,  # (B, MB)
    seq_lens_ptr,  # (B,)
    query_start_loc_ptr,  # (B+1,)
    out_ptr,  # (T, H, D) — written when not SPLIT
    part_out_ptr,  # (num_splits, T, H, BLOCK_D) fp32, unnormalised — written when SPLIT
    part_ml_ptr,  # (num_splits, T, H, 2) fp32: running max (base 2) and sum of exp2
    k_scale_ptr, v_scale_ptr,  # (KVH,) fp32 — read only for fp8 caches
    num_seqs, block_size, qk_scale, tiles_per_split,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ot, stride_oh, stride_od,
    stride_ps, stride_pt, stride_ph,
    stride_ms, stride_mt, stride_mh,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile_idx, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    q_tile = tile_idx - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    prefix_len = seq_len - q_len

    # Rows of the tile: query token (row // GROUP) x query head (row % GROUP) of this KV head.
    rows = tl.arange(0, BLOCK_M)  # (M,)
    q_idx = q_tile * BLOCK_Q + rows // GROUP  # (M,) query index within the sequence
    heads = kv_head * GROUP + rows % GROUP  # (M,)
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)  # (M,)
    q_pos = prefix_len + q_idx  # (M,) position of each query in its sequence
    dims = tl.arange(0, BLOCK_D)  # (D,)
    d_valid = dims < HEAD_DIM  # folds away when HEAD_DIM == BLOCK_D
    tokens64 = (q_start + q_idx).to(tl.int64)
    heads64 = heads.to(tl.int64)
    dims64 = dims.to(tl.int64)

    q_offs = tokens64[:, None] * stride_qt + heads64[:, None] * stride_qh + dims64[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)  # (M, D)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this tile needs: up to its last query's position, in splits of tiles_per_split tiles.
    last_q = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_len = prefix_len + last_q + 1
    num_tiles = tl.cdiv(kv_len, TILE_N)

    KV_FP8: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.float8e4nv
    if KV_FP8:  # dequantize K through the softmax scale (V: the output, below)
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_btb
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    if SPLIT:  # this program's split; _reduce_splits_kernel folds them
        m_i, l_i, acc = _attend_split(split, tiles_per_split, num_tiles, q, q_pos, kv_len, table_row, k_head,
            v_head, dims64, d_valid, block_size, qk_scale, stride_btn, stride_kb, stride_ks, stride_kd, stride_vb,
            stride_vs, stride_vd, BLOCK_M, BLOCK_D, TILE_N, UPCAST, DOT_PRECISION, KV_FP8, INTERPRETED)  # fmt: skip
        split64 = split.to(tl.int64)
        p_offs = split64 * stride_ps + tokens64[:, None] * stride_pt + heads64[:, None] * stride_ph + dims64[None, :]
        tl.store(part_out_ptr + p_offs, acc, mask=row_valid[:, None])
        ml = part_ml_ptr + split64 * stride_ms + tokens64 * stride_mt + heads64 * stride_mh
        tl.store(ml, m_i, mask=row_valid)
        tl.store(ml + 1, l_i, mask=row_valid)
    else:  # every split of the tile in order, folded as it ends
        m_run = tl.full([BLOCK_M], _EMPTY, tl.float32)
        l_run = tl.zeros([BLOCK_M], tl.float32)
        o_run = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        num_splits = tl.cdiv(num_tiles, tiles_per_split)
        if INTERPRETED:
            s = 0
            while s < num_splits:
                m_i, l_i, acc = _attend_split(s, tiles_per_split, num_tiles, q, q_pos, kv_len, table_row, k_head,
                    v_head, dims64, d_valid, block_size, qk_scale, stride_btn, stride_kb, stride_ks, stride_kd,
                    stride_vb, stride_vs, stride_vd, BLOCK_M, BLOCK_D, TILE_N, UPCAST, DOT_PRECISION, KV_FP8,
                    INTERPRETED)  # fmt: skip
                m_run, l_run, o_run = _fold(m_run, l_run, o_run, m_i, l_i, acc)
                s += 1
        else:
            for s in range(0, num_splits):
                m_i, l_i, acc = _attend_split(s, tiles_per_split, num_tiles, q, q_pos, kv_len, table_row, k_head,
                    v_head, dims64, d_valid, block_size, qk_scale, stride_btn, stride_kb, stride_ks, stride_kd,
                    stride_vb, stride_vs, stride_vd, BLOCK_M, BLOCK_D, TILE_N, UPCAST, DOT_PRECISION, KV_FP8,
                    INTERPRETED)  # fmt: skip
                m_run, l_run, o_run = _fold(m_run, l_run, o_run, m_i, l_i, acc)
        o = o_run / tl.where(l_run > 0.0, l_run, 1.0)[:, None]  # (M, D)
        if KV_FP8:
            o = o * tl.load(v_scale_ptr + kv_head)
        o_offs = tokens64[:, None] * stride_ot + heads64[:, None] * stride_oh + dims64[None, :] * stride_od
        tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr,  # (S, T, H, BLOCK_D) fp32, unnormalised
    part_ml_ptr,  # (S, T, H, 2) fp32
    out_ptr,  # (T, H, D)
    v_scale_ptr,  # (KVH,) fp32 — read only for fp8 caches
    num_splits, num_heads,
    stride_ps, stride_pt, stride_ph,
    stride_ms, stride_mt, stride_mh,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Fold the split partials of one token's heads [h0, h0 + BLOCK_H) in split order (`_fold`)."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BH,)
    h_valid = heads < num_heads
    heads64 = heads.to(tl.int64)
    dims = tl.arange(0, BLOCK_D).to(tl.int64)  # (D,)
    m_run = tl.full([BLOCK_H], _EMPTY, tl.float32)
    l_run = tl.zeros([BLOCK_H], tl.float32)
    o_run = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if INTERPRETED:
        s = tl.program_id(0) * 0
        while s < num_splits:
            m_run, l_run, o_run = _fold_stored(m_run, l_run, o_run, s, token, heads64, h_valid, dims, part_out_ptr,
                part_ml_ptr, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_mh)  # fmt: skip
            s += 1
    else:
        for s in range(0, num_splits):
            m_run, l_run, o_run = _fold_stored(m_run, l_run, o_run, s, token, heads64, h_valid, dims, part_out_ptr,
                part_ml_ptr, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_mh)  # fmt: skip
    o = o_run / tl.where(l_run > 0.0, l_run, 1.0)[:, None]  # (BH, D)
    if KV_FP8:
        o = o * tl.load(v_scale_ptr + heads // GROUP, mask=h_valid, other=1.0)[:, None]
    o_offs = token * stride_ot + heads64[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=h_valid[:, None] & (dims[None, :] < HEAD_DIM))


@triton.jit
def _fold_stored(
    m_run, l_run, o_run, s, token, heads64, h_valid, dims, part_out_ptr, part_ml_ptr,
    stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_mh,
):  # fmt: skip
    """`_fold` of split s's stored partial of these heads."""
    s64 = s.to(tl.int64)
    ml = part_ml_ptr + s64 * stride_ms + token * stride_mt + heads64 * stride_mh
    m = tl.load(ml, mask=h_valid, other=_EMPTY)
    l_sum = tl.load(ml + 1, mask=h_valid, other=0.0)
    acc = tl.load(
        part_out_ptr + s64 * stride_ps + token * stride_pt + heads64[:, None] * stride_ph + dims[None, :],
        mask=h_valid[:, None],
        other=0.0,
    )  # (BH, D)
    return _fold(m_run, l_run, o_run, m, l_sum, acc)


def _tile_config(group: int, block_d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages): a function of the GQA group and head size only, never
    of the batch, so every query runs through tiles of one shape."""
    block_m = max(64, triton.next_power_of_2(group))  # one warpgroup's MMA (Hopper wgmma takes M = 64)
    return block_m, (64 if block_d <= 128 else 32), 4, 2


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    split_keys: int = SPLIT_KEYS,
    block_m: int | None = None,
    tile_n: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention over the paged KV cache with Triton kernels; `reference.paged_attention`
    defines the result. q: (T, H, D) fp32/fp16/bf16; k_cache, v_cache: (NB, BS, KVH, D) of q's dtype
    or fp8 (e4m3) with keyword-only `k_scale`, `v_scale` (KVH,) float32, H % KVH == 0, D <= 256;
    block_tables: (B, MB); seq_lens: (B,); query_start_loc: (B+1,); index tensors int32/int64; out:
    optional (T, H, D). Returns (T, H, D) in q's dtype, accumulated in fp32, without reading any
    tensor value on the host.

    Batch invariant (module docstring): for the same knobs, a query's output is the same bits whatever
    else is in the batch and however its sequence's tokens are split into calls. Keyword-only knobs:
    `split_keys` (a query's keys are split every `split_keys` positions, a power of two and a multiple
    of the tile; decode-like batches run the splits in parallel), `block_m` (rows of a query tile, a
    power of two >= the padded GQA group), `tile_n` (keys per tile, a power of two >= 16). Results
    for different knobs agree to rounding, not bit for bit.
    """
    check_paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, TRITON_DTYPES, k_scale, v_scale
    )
    total_q, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = block_tables.shape[0]
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} > 256 is not supported by the Triton kernel")
    if out is None:
        out = torch.empty_like(q)
    if total_q == 0 or batch == 0:
        return out
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else float(scale)

    block_d = max(16, triton.next_power_of_2(head_dim))
    cfg_m, cfg_n, num_warps, num_stages = _tile_config(group, block_d)
    block_m = cfg_m if block_m is None else block_m
    tile_n = cfg_n if tile_n is None else tile_n
    if block_m < triton.next_power_of_2(group) or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m} must be a power of two >= the padded GQA group {group}")
    if tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n={tile_n} must be a power of two >= 16")
    if split_keys < tile_n or split_keys & (split_keys - 1):
        raise ValueError(f"split_keys={split_keys} must be a power of two >= tile_n ({tile_n})")
    block_q = block_m // group

    # Decode-like batches (one query per sequence) run each split as its own program: as many as the
    # longest table can hold (its width, a host shape: no sync); programs past a sequence's keys store
    # empty partials, which the fold leaves out exactly.
    num_splits = triton.cdiv(block_tables.shape[1] * block_size, split_keys) if total_q <= batch else 1
    split = num_splits > 1
    # (S, T, H, BLOCK_D) and (S, T, H, 2) partials; without splits a dummy the kernel never touches
    part_out = q.new_empty((num_splits, total_q, num_heads, block_d) if split else (1, 1, 1, 1), dtype=torch.float32)
    part_ml = q.new_empty((*part_out.shape[:3], 2), dtype=torch.float32)

    num_q_tiles = total_q // block_q + batch  # upper bound on the tiles of all sequences
    _attention_kernel[(num_q_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, part_out, part_ml,
        k_scale if k_scale is not None else part_ml, v_scale if v_scale is not None else part_ml,
        batch, block_size, scale * _LOG2E, split_keys // tile_n,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        *part_out.stride()[:3], *part_ml.stride()[:3],
        HEAD_DIM=head_dim, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n, BLOCK_D=block_d,
        SPLIT=split, UPCAST=not q.is_cuda, INTERPRETED=not q.is_cuda,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split:
        block_h = min(triton.next_power_of_2(num_heads), max(1, 8192 // block_d))
        _reduce_splits_kernel[(total_q, triton.cdiv(num_heads, block_h))](
            part_out, part_ml, out, v_scale if v_scale is not None else part_ml, num_splits, num_heads,
            *part_out.stride()[:3], *part_ml.stride()[:3], *out.stride(),
            HEAD_DIM=head_dim, GROUP=group, BLOCK_H=block_h, BLOCK_D=block_d, KV_FP8=v_scale is not None,
            INTERPRETED=not q.is_cuda, num_warps=4,
        )  # fmt: skip
    return out
