"""Pure-torch `write_kv` and `paged_attention`: the oracle of the tests and the CPU execution path.

Same signatures as the public kernels of `helexa.kernels`; vectorised over tokens and heads, with a
Python loop only over the sequences (and over query chunks of very long prefills).

fp8 caches (`--kv-cache-dtype fp8`): `write_kv` stores `quantize_fp8(x, scale)` and
`paged_attention` reads `dequantize_fp8(cache, scale)`, with one float32 scale per KV head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from helexa.kernels._checks import FP8_KV_DTYPE, FP8_KV_MAX, TRITON_DTYPES, check_paged_attention, check_write_kv

__all__ = ["dequantize_fp8", "paged_attention", "quantize_fp8", "write_kv"]

_FLOAT_DTYPES = (*TRITON_DTYPES, torch.float64)  # float64: the tests' oracle
# Bound on score-matrix elements per chunk of queries (~256 MiB in fp32).
_MAX_SCORE_ELEMENTS = 1 << 26
_T = TypeVar("_T")
# kind -> (copies of the input tensors, what was derived from them)
_MEMO: dict[str, tuple[tuple[torch.Tensor, ...], Any]] = {}


def _memoised(kind: str, inputs: tuple[torch.Tensor, ...], derive: Callable[[], _T]) -> _T:
    """`derive()`, reused while called again with inputs of equal contents (dtype, shape and values):
    a model's layers share one step's index tensors, so the index work derived from them is done once
    per step rather than once per layer. Comparing contents (not identities) keeps this right for
    buffers reused or modified in place between calls."""
    hit = _MEMO.get(kind)
    if hit is not None and len(hit[0]) == len(inputs):
        if all(a.dtype == b.dtype and a.device == b.device and torch.equal(a, b) for a, b in zip(hit[0], inputs)):
            return hit[1]
    value = derive()
    _MEMO[kind] = (tuple(t.clone() for t in inputs), value)
    return value


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: (..., KVH, D) of any float dtype; scale: (KVH,) float32 -> e4m3 of `x / scale` in float32,
    saturated to ±448 (never inf or NaN for finite x), rounded to nearest, ties to even."""
    return (x.to(torch.float32) / scale[:, None]).clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x: (..., KVH, D) e4m3; scale: (KVH,) float32 -> `x * scale` in `dtype` (float32 or float64)."""
    return x.to(dtype) * scale.to(dtype)[:, None]


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
    """Scatter new K/V rows into their cache slots, in place, for caches of any strides.

    k, v: (T, KVH, D); k_cache, v_cache: (NB, BS, KVH, D); slot_mapping: (T,) int32/int64. Token t
    goes to block `slot // BS`, row `slot % BS`; slot -1 skips it. Nothing else in the caches changes.
    fp8 caches take `k_scale`, `v_scale` (KVH,) float32 and store `quantize_fp8(k, k_scale)` etc.;
    a 16-bit cache under float32 k, v stores them rounded to nearest in its dtype.
    """
    check_write_kv(k, v, k_cache, v_cache, slot_mapping, _FLOAT_DTYPES, k_scale, v_scale, half_cache=True)
    block_size = k_cache.shape[1]

    def slots() -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        keep = slot_mapping >= 0  # (T,) bool
        everything = bool(keep.all())
        kept = slot_mapping.long() if everything else slot_mapping[keep].long()  # (T',)
        return None if everything else keep, kept // block_size, kept % block_size

    keep, blocks, offsets = _memoised(f"write_kv/{block_size}", (slot_mapping,), slots)
    if keep is not None:
        k, v = k[keep], v[keep]
    if k_scale is not None and v_scale is not None:
        k, v = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    k_cache[blocks, offsets] = k.to(k_cache.dtype)  # a 16-bit cache rounds to nearest
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


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
    """Variable-length causal attention over the paged KV cache (decode, prefill and extend alike).

    q: (T, H, D), the new queries of all sequences back to back; k_cache, v_cache: (NB, BS, KVH, D),
    H a multiple of KVH (query head h reads KV head h // (H // KVH)); block_tables: (B, MB);
    seq_lens: (B,) context lengths including the new tokens; query_start_loc: (B+1,) prefix sums of
    query lengths; scale defaults to D**-0.5; out: optional (T, H, D) buffer. Query i of sequence b
    sits at position seq_lens[b] - q_len_b + i and attends to positions <= it. Softmax in float32
    (float64 for float64 inputs). Returns (T, H, D) in q's dtype (`out` itself when given). Reads
    the lengths on the host (a device sync). fp8 caches take `k_scale`, `v_scale` (KVH,) float32 and
    are read as `dequantize_fp8(cache, scale)` in the compute dtype; 16-bit caches under float32 q
    are read widened to float32.
    """
    check_paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, _FLOAT_DTYPES, k_scale, v_scale,
        half_cache=True,
    )  # fmt: skip
    total_q, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else float(scale)
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if out is None:
        out = torch.empty_like(q)
    if k_scale is not None and v_scale is not None:  # (KVH, 1, 1) each, to scale (KVH, N, D)
        scales = (k_scale.to(compute_dtype)[:, None, None], v_scale.to(compute_dtype)[:, None, None])
    else:
        scales = None

    plan = _memoised(
        f"paged_attention/{block_size}",
        (block_tables, seq_lens, query_start_loc),
        lambda: _StepPlan.of(block_tables, seq_lens, query_start_loc, block_size, num_kv_heads * head_dim),
    )
    starts, lens = plan.starts, plan.lens
    for group_plan in plan.decode_groups:  # single-token queries, batched; the loop below does the others
        _decode_group(q, k_cache, v_cache, group_plan, scale, compute_dtype, out, scales)
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0 or b in plan.decode:
            continue
        blocks = block_tables[b, : -(-seq_len // block_size)].long()  # (nb,)
        # (KVH, N, D) each
        k, v = (c[blocks].flatten(0, 1)[:seq_len].to(compute_dtype).transpose(0, 1) for c in (k_cache, v_cache))
        if scales is not None:  # fp8: dequantize
            k, v = k * scales[0], v * scales[1]
        key_pos = torch.arange(seq_len, device=q.device)  # (N,)

        chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, num_heads * seq_len))
        if compute_dtype != torch.float64 and q_len == seq_len:
            # A whole prompt in one call of torch's fused causal attention (the CPU serving path);
            # float64 — the tests' oracle — keeps the explicit softmax below.
            qs = q[q_start:q_end].to(compute_dtype).transpose(0, 1)[None]  # (1, H, L, D)
            o = F.scaled_dot_product_attention(
                qs, k[None], v[None], is_causal=True, scale=scale, enable_gqa=True
            )  # (1, H, L, D)
            out[q_start:q_end] = o[0].transpose(0, 1).to(out.dtype)
            continue
        if compute_dtype != torch.float64:  # a chunk after a cached prefix (extend): fused attention, masked
            for c0 in range(0, q_len, chunk):
                c1 = min(q_len, c0 + chunk)
                qs = q[q_start + c0 : q_start + c1].to(compute_dtype).transpose(0, 1)[None]  # (1, H, L, D)
                query_pos = seq_len - q_len + torch.arange(c0, c1, device=q.device)  # (L,)
                visible = key_pos[None, :] <= query_pos[:, None]  # (L, N)
                o = F.scaled_dot_product_attention(
                    qs, k[None], v[None], attn_mask=visible, scale=scale, enable_gqa=True
                )  # (1, H, L, D)
                out[q_start + c0 : q_start + c1] = o[0].transpose(0, 1).to(out.dtype)
            continue
        for c0 in range(0, q_len, chunk):
            c1 = min(q_len, c0 + chunk)
            qs = q[q_start + c0 : q_start + c1].to(compute_dtype)  # (L, H, D)
            qs = qs.view(c1 - c0, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # (KVH, G, L, D)
            scores = torch.matmul(qs, k[:, None].transpose(-1, -2)) * scale  # (KVH, G, L, N)
            query_pos = seq_len - q_len + torch.arange(c0, c1, device=q.device)  # (L,)
            future = key_pos[None, :] > query_pos[:, None]  # (L, N)
            scores = scores.masked_fill(future, float("-inf"))
            probs = torch.softmax(scores, dim=-1)  # (KVH, G, L, N)
            o = torch.matmul(probs, v[:, None])  # (KVH, G, L, D)
            out[q_start + c0 : q_start + c1] = o.permute(2, 0, 1, 3).reshape(c1 - c0, num_heads, head_dim).to(out.dtype)
    return out


@dataclass(frozen=True)
class _DecodeGroup:
    """Index tensors of a group of single-token queries whose padded K/V are gathered together."""

    rows: torch.Tensor  # (Bd,) query rows (= sequences' start offsets)
    blocks: torch.Tensor  # (Bd * nb,) block ids to gather, padding blocks replaced by block 0
    pad: torch.Tensor  # (Bd, N) True past a sequence's end, N = nb * block_size
    pad_rows: torch.Tensor  # (P,) flat positions of the padding in the gathered (Bd * N) rows
    size: int  # Bd
    positions: int  # N


@dataclass(frozen=True)
class _StepPlan:
    """Host lengths and decode gather indices of one step (one per step, shared by every layer)."""

    starts: list[int]  # B + 1 query offsets
    lens: list[int]  # B context lengths
    decode: frozenset[int]  # sequences with a single new token
    decode_groups: tuple[_DecodeGroup, ...]

    @staticmethod
    def of(
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_size: int,
        per_token: int,
    ) -> _StepPlan:
        """Single-token queries grouped by length (similar lengths together: less padding) into groups
        whose padded K/V stay under `_MAX_SCORE_ELEMENTS` elements (`per_token` = KVH * D)."""
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        decode = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
        order = sorted(decode, key=lambda b: lens[b])
        device = block_tables.device
        groups = []
        i = 0
        while i < len(order):
            j = i + 1
            while j < len(order) and (j + 1 - i) * lens[order[j]] * per_token <= _MAX_SCORE_ELEMENTS:
                j += 1
            batch = order[i:j]
            i = j
            nb = -(-lens[batch[-1]] // block_size)
            n = nb * block_size
            idx = torch.tensor(batch, device=device)
            group_lens = torch.tensor([lens[b] for b in batch], device=device)  # (Bd,)
            pad = torch.arange(n, device=device)[None, :] >= group_lens[:, None]  # (Bd, N)
            blocks = block_tables[idx, :nb].long()  # (Bd, nb)
            blocks = blocks.masked_fill(pad.view(len(batch), nb, block_size)[:, :, 0], 0)  # never past the pool
            rows = torch.tensor([starts[b] for b in batch], device=device)
            pad_rows = pad.flatten().nonzero().squeeze(1)
            groups.append(_DecodeGroup(rows, blocks.flatten(), pad, pad_rows, len(batch), n))
        return _StepPlan(starts, lens, frozenset(decode), tuple(groups))


def _decode_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _DecodeGroup,
    scale: float,
    compute_dtype: torch.dtype,
    out: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """The single-token queries of one `_DecodeGroup` in a few batched ops (the CPU decode path).
    Positions past a sequence's end are zeroed in K and V and masked out of the scores, so the padding
    (even NaN) never reaches `out`. `scales`: an fp8 cache's (k_scale, v_scale), each (KVH, 1, 1)."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    bd, n = plan.size, plan.positions
    # index_select, not advanced indexing: one contiguous gather (several times faster on CPU).
    k = k_cache.index_select(0, plan.blocks).view(bd, n, num_kv_heads, head_dim).to(compute_dtype)
    v = v_cache.index_select(0, plan.blocks).view(bd, n, num_kv_heads, head_dim).to(compute_dtype)
    if scales is not None:  # fp8: dequantize, (KVH, 1) per head
        k, v = k * scales[0][:, 0], v * scales[1][:, 0]
    for t in (k, v):  # padding (even NaN) out of reach: masked scores of NaN keys would still be NaN
        t.view(bd * n, num_kv_heads, head_dim).index_fill_(0, plan.pad_rows, 0.0)  # (Bd, N, KVH, D)
    qs = q.index_select(0, plan.rows).to(compute_dtype)  # (Bd, H, D)
    if compute_dtype != torch.float64:  # torch's fused attention; float64 (the oracle) keeps the math below
        o = F.scaled_dot_product_attention(
            qs[:, :, None],
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=~plan.pad[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )  # (Bd, H, 1, D)
        out.index_copy_(0, plan.rows, o[:, :, 0].to(out.dtype))
        return
    group = num_heads // num_kv_heads
    kt = k.permute(0, 2, 3, 1)  # (Bd, KVH, D, N)
    scores = torch.matmul(qs.view(bd, num_kv_heads, group, head_dim), kt) * scale  # (Bd, KVH, G, N)
    scores = scores.masked_fill(plan.pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # (Bd, KVH, G, N)
    o = torch.matmul(probs, v.permute(0, 2, 1, 3))  # (Bd, KVH, G, D)
    out.index_copy_(0, plan.rows, o.reshape(bd, num_heads, head_dim).to(out.dtype))
