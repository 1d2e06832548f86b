"""Pure-torch references of the kernels: the oracle for tests and the CPU execution path.

Same names and signatures as the public kernels in `helexa.kernels` (see SPEC.md, Kernels).
Written for clarity over speed, but vectorised over tokens and heads so a small model can serve
from them on CPU: the only Python loop is over the sequences of the batch (and, for very long
prefills, over chunks of queries to bound the score matrix).
"""

from __future__ import annotations

import torch

from helexa.kernels._checks import check_paged_attention, check_write_kv

__all__ = ["write_kv", "paged_attention"]

# The references also accept float64 so tests can compute the oracle in double precision.
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Bound on score-matrix elements per chunk of queries (~256 MiB in fp32).
_MAX_SCORE_ELEMENTS = 1 << 26


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V rows into their cache slots, in place.

    k, v: (T, KVH, D) new keys/values; k_cache, v_cache: (NB, BS, KVH, D);
    slot_mapping: (T,) int — token t goes to block `slot // BS`, row `slot % BS`; `-1` skips it.
    Guarantees: every slot named in `slot_mapping` holds its row afterwards; no other cache entry
    changes. Works for any strides of the caches.
    """
    check_write_kv(k, v, k_cache, v_cache, slot_mapping, _FLOAT_DTYPES)
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0  # (T,) bool
    slots = slot_mapping[keep].long()  # (T',)
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep]
    v_cache[blocks, offsets] = v[keep]


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
    """Variable-length causal attention over the paged KV cache (decode, prefill and extend alike).

    q: (T, H, D), the new query tokens of all sequences back to back; k_cache, v_cache:
    (NB, BS, KVH, D) with H a multiple of KVH (query head h reads KV head h // (H // KVH));
    block_tables: (B, MB) block ids per sequence; seq_lens: (B,) context lengths including the new
    tokens; query_start_loc: (B+1,) prefix sums of query lengths; scale defaults to D**-0.5;
    out: optional (T, H, D) output buffer.
    Query i of sequence b sits at position seq_lens[b] - q_len_b + i and attends to the positions
    <= it. Scores and softmax are computed in float32 (float64 for float64 inputs). Returns
    (T, H, D) in q's dtype (`out` itself when given). Synchronises with the device (reads the
    lengths on the host).
    """
    check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, _FLOAT_DTYPES)
    total_q, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else float(scale)
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if out is None:
        out = torch.empty_like(q)

    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[b, :num_blocks].long()  # (nb,)
        k = k_cache[blocks].reshape(num_blocks * block_size, num_kv_heads, head_dim)[:seq_len]  # (N, KVH, D)
        v = v_cache[blocks].reshape(num_blocks * block_size, num_kv_heads, head_dim)[:seq_len]  # (N, KVH, D)
        k = k.to(compute_dtype).transpose(0, 1)  # (KVH, N, D)
        v = v.to(compute_dtype).transpose(0, 1)  # (KVH, N, D)
        key_pos = torch.arange(seq_len, device=q.device)  # (N,)

        chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, num_heads * seq_len))
        for c0 in range(0, q_len, chunk):
            c1 = min(q_len, c0 + chunk)
            qs = q[q_start + c0 : q_start + c1].to(compute_dtype)  # (L, H, D)
            qs = qs.view(c1 - c0, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # (KVH, G, L, D)
            scores = torch.einsum("kgld,knd->kgln", qs, k) * scale  # (KVH, G, L, N)
            query_pos = seq_len - q_len + torch.arange(c0, c1, device=q.device)  # (L,)
            future = key_pos[None, :] > query_pos[:, None]  # (L, N)
            scores = scores.masked_fill(future, float("-inf"))
            probs = torch.softmax(scores, dim=-1)  # (KVH, G, L, N)
            o = torch.einsum("kgln,knd->lkgd", probs, v)  # (L, KVH, G, D)
            out[q_start + c0 : q_start + c1] = o.reshape(c1 - c0, num_heads, head_dim).to(out.dtype)
    return out
