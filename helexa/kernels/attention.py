"""Triton `paged_attention`: varlen causal attention over the paged KV cache (decode, prefill, extend).

A program handles one (query tile, KV head, split): up to `BLOCK_Q` queries of one sequence times
the `GROUP` query heads of the KV head (`BLOCK_M = BLOCK_Q * GROUP` rows), so a K/V tile is read
once per GQA group. It finds its sequence by binary search over `query_start_loc` (no host copy at
launch) and walks the keys in tiles of `TILE_N` positions through the block table, with an online
base-2 softmax in fp32. With `num_splits > 1` (flash-decoding) each program covers a share of the
keys and writes a partial output and its log-sum-exp, merged by `_reduce_splits_kernel`. Offsets
are 64-bit, so pools over 2^31 elements work.

fp8 (e4m3) caches are converted on load to q's dtype (exact: every e4m3 value is a bf16, fp16 and
fp32 value); the KV head's `k_scale` is folded into the softmax scale and its `v_scale` multiplies
the output, so the dot products run at q's precision, as for an unquantized cache.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from helexa.kernels._checks import TRITON_DTYPES, check_paged_attention

__all__ = ["choose_num_splits", "paged_attention_triton"]

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 32
_MAX_FORCED_SPLITS = 64  # the reduce holds all splits of a tile of heads in registers
# Splits used where there is no device to size against (CPU, the Triton interpreter): small, and
# not a power of two, so tests exercise the padded split axis of the reduce.
_INTERPRETER_SPLITS = 3


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
def _attention_kernel(
    q_ptr,  # (T, H, D)
    k_cache_ptr, v_cache_ptr,  # (NB, BS, KVH, D)
    block_tables_ptr,  # (B, MB)
    seq_lens_ptr,  # (B,)
    query_start_loc_ptr,  # (B+1,)
    out_ptr,  # (T, H, D) — written when not SPLIT
    part_out_ptr,  # (num_splits, T, H, BLOCK_D) fp32 — written when SPLIT
    part_lse_ptr,  # (num_splits, T, H) fp32, base-2 log-sum-exp
    k_scale_ptr, v_scale_ptr,  # (KVH,) fp32 — read only for fp8 caches
    num_seqs, block_size, qk_scale, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ot, stride_oh, stride_od,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
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

    # Keys this tile needs: up to its last query's position. This split walks its share of them.
    last_q = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_len = prefix_len + last_q + 1
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    KV_FP8: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.float8e4nv
    if KV_FP8:  # dequantize K through the softmax scale (V: the output, below)
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # running max (base 2); finite so empty rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_btb
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
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

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]  # (M, D)
    if KV_FP8:
        o = o * tl.load(v_scale_ptr + kv_head)
    if not SPLIT:
        o_offs = tokens64[:, None] * stride_ot + heads64[:, None] * stride_oh + dims64[None, :] * stride_od
        tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))  # (M,)
        split64 = split.to(tl.int64)
        p_offs = split64 * stride_ps + tokens64[:, None] * stride_pt + heads64[:, None] * stride_ph + dims64[None, :]
        tl.store(part_out_ptr + p_offs, o, mask=row_valid[:, None])
        tl.store(part_lse_ptr + split64 * stride_ls + tokens64 * stride_lt + heads64, lse, mask=row_valid)


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr,  # (S, T, H, BLOCK_D) fp32
    part_lse_ptr,  # (S, T, H) fp32
    out_ptr,  # (T, H, D)
    num_splits, num_heads,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Merge the split partials of one token's heads [h0, h0 + BLOCK_H), weighting by exp2(lse)."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BH,)
    h_valid = heads < num_heads
    heads64 = heads.to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD).to(tl.int64)  # (S,)
    s_valid = splits < num_splits
    dims = tl.arange(0, BLOCK_D).to(tl.int64)  # (D,)

    lse_mask = s_valid[:, None] & h_valid[None, :]  # (S, BH)
    lse = tl.load(
        part_lse_ptr + splits[:, None] * stride_ls + token * stride_lt + heads64[None, :],
        mask=lse_mask,
        other=float("-inf"),
    )  # (S, BH)
    lse_max = tl.max(lse, 0)  # (BH,)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # padded heads: keep exp2 finite
    weight = tl.exp2(lse - lse_max[None, :])  # (S, BH) — empty splits (lse = -inf) weigh 0
    parts = tl.load(
        part_out_ptr + splits[:, None, None] * stride_ps + token * stride_pt
        + heads64[None, :, None] * stride_ph + dims[None, None, :],
        mask=(weight > 0.0)[:, :, None],
        other=0.0,
    )  # (S, BH, D)  # fmt: skip
    total = tl.sum(weight, 0)  # (BH,)
    total = tl.where(total > 0.0, total, 1.0)
    o = tl.sum(parts * weight[:, :, None], 0) / total[:, None]  # (BH, D)
    o_offs = token * stride_ot + heads64[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=h_valid[:, None] & (dims[None, :] < HEAD_DIM))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_programs: int, num_sms: int, max_splits: int = _MAX_SPLITS) -> int:
    """Flash-decoding split count: 1 when `num_programs` (sequences x KV heads) fill the `num_sms`
    SMs, else enough splits for about two programs per SM, capped at `max_splits`."""
    if num_programs <= 0 or num_programs >= num_sms:
        return 1
    return max(1, min(max_splits, math.ceil(2 * num_sms / num_programs)))


def _tile_config(decode_like: bool, group: int, block_d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages) for the attention kernel."""
    group_pad = triton.next_power_of_2(group)
    if decode_like:
        block_m = max(16, group_pad)
        return block_m, (64 if block_d <= 128 else 32), 4, 2
    if block_d <= 128:
        return max(128, group_pad), 64, 8, 3
    return max(64, group_pad), 32, 8, 2


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
    num_splits: int | None = None,
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

    Keyword-only tuning knobs, same result for any choice: `num_splits` (flash-decoding splits;
    default: sized against the SMs for batches of one query per sequence, else 1), `block_m` (rows
    of a query tile, a power of two >= the padded GQA group), `tile_n` (keys per tile, a power of
    two >= 16).
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
    decode_like = total_q <= batch
    cfg_m, cfg_n, num_warps, num_stages = _tile_config(decode_like, group, block_d)
    block_m = cfg_m if block_m is None else block_m
    tile_n = cfg_n if tile_n is None else tile_n
    if block_m < triton.next_power_of_2(group) or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m} must be a power of two >= the padded GQA group {group}")
    if tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n={tile_n} must be a power of two >= 16")
    block_q = block_m // group

    if num_splits is None:  # only decode-like batches split, sized against the SMs where there are some
        num_splits = _INTERPRETER_SPLITS if decode_like else 1
        if decode_like and q.is_cuda:
            num_splits = choose_num_splits(batch * num_kv_heads, _sm_count(q.device.index or 0))
    if not 1 <= num_splits <= _MAX_FORCED_SPLITS:
        raise ValueError(f"num_splits={num_splits} must be in [1, {_MAX_FORCED_SPLITS}]")
    split = num_splits > 1
    # (S, T, H, BLOCK_D) and (S, T, H) partials; without splits a dummy the kernel never touches
    part_out = q.new_empty((num_splits, total_q, num_heads, block_d) if split else (1, 1, 1, 1), dtype=torch.float32)
    part_lse = q.new_empty(part_out.shape[:3], dtype=torch.float32)

    num_q_tiles = total_q // block_q + batch  # upper bound on the tiles of all sequences
    _attention_kernel[(num_q_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, part_out, part_lse,
        k_scale if k_scale is not None else part_lse, v_scale if v_scale is not None else part_lse,
        batch, block_size, scale * _LOG2E, num_splits,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        *part_out.stride()[:3], *part_lse.stride()[:2],
        HEAD_DIM=head_dim, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n, BLOCK_D=block_d,
        SPLIT=split, UPCAST=not q.is_cuda, INTERPRETED=not q.is_cuda,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split:
        splits_pad = triton.next_power_of_2(num_splits)
        block_h = min(triton.next_power_of_2(num_heads), max(1, 8192 // (splits_pad * block_d)))
        _reduce_splits_kernel[(total_q, triton.cdiv(num_heads, block_h))](
            part_out, part_lse, out, num_splits, num_heads,
            *part_out.stride()[:3], *part_lse.stride()[:2], *out.stride(),
            HEAD_DIM=head_dim, SPLITS_PAD=splits_pad, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out
