"""Random paged-attention problems, their contiguous SDPA baselines, and byte/FLOP counts.

Shared by `bench/test_bench_kernels.py` (pytest-benchmark) and `bench/gpu_check.py`.
A problem is a batch given as [(prefix_len, q_len), ...]; the pool holds exactly the blocks the
batch needs (plus a few spare), handed out in a random order so block tables are scattered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Problem:
    name: str
    seqs: list[tuple[int, int]]  # (prefix_len, q_len) per sequence
    q: torch.Tensor  # (T, H, D)
    k_cache: torch.Tensor  # (NB, BS, KVH, D)
    v_cache: torch.Tensor  # (NB, BS, KVH, D)
    block_tables: torch.Tensor  # (B, MB) int32
    seq_lens: torch.Tensor  # (B,) int32
    query_start_loc: torch.Tensor  # (B+1,) int32

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc

    @property
    def decode_bytes(self) -> int:
        """Bytes a decode step must move: K and V of every context position, plus Q and O."""
        _, _, kv_heads, head_dim = self.k_cache.shape
        elem = self.q.element_size()
        kv = 2 * sum(p + n for p, n in self.seqs) * kv_heads * head_dim * elem
        return kv + 2 * self.q.numel() * elem

    @property
    def causal_flops(self) -> int:
        """Matmul FLOPs of causal attention: 4 * H * D per (query, visible key) pair."""
        _, num_heads, head_dim = self.q.shape
        pairs = sum(n * p + n * (n + 1) // 2 for p, n in self.seqs)
        return 4 * num_heads * head_dim * pairs


def make_problem(
    name: str,
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int = 0,
) -> Problem:
    """Random inputs (never zeros) for `seqs` with scattered, non-contiguous block tables."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = [-(-(p + n) // block_size) for p, n in seqs]
    num_blocks = sum(per_seq) + 4
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros((len(seqs), max(per_seq)), dtype=torch.int32)
    start = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = order[start : start + n]
        start += n
    q_lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    seq_lens = torch.tensor([p + n for p, n in seqs], dtype=torch.int32)
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=dev_gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=dev_gen, device=device, dtype=dtype)
    q = torch.randn((int(q_lens.sum()), num_heads, head_dim), generator=dev_gen, device=device, dtype=dtype)
    return Problem(name, list(seqs), q, k_cache, v_cache, table.to(device), seq_lens.to(device), qsl.to(device))


def gathered_sdpa(problem: Problem):
    """A closure running SDPA over a contiguous, padded copy of the problem's K/V (the baseline).

    The copy is made here, outside the timed call: (B, KVH, Nmax, D) keys/values, (B, H, Lmax, D)
    queries, and a boolean mask (bottom-right causal, padding hidden) unless every sequence is a
    plain causal prefill or a full-length decode of the same length.
    """
    q, k_cache, v_cache = problem.q, problem.k_cache, problem.v_cache
    _, block_size, kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    batch = len(problem.seqs)
    n_max = max(p + n for p, n in problem.seqs)
    l_max = max(n for _, n in problem.seqs)
    dev = q.device
    k = torch.zeros((batch, kv_heads, n_max, head_dim), dtype=q.dtype, device=dev)
    v = torch.zeros_like(k)
    qq = torch.zeros((batch, num_heads, l_max, head_dim), dtype=q.dtype, device=dev)
    starts = problem.query_start_loc.tolist()
    for b, (prefix, q_len) in enumerate(problem.seqs):
        n = prefix + q_len
        blocks = problem.block_tables[b, : -(-n // block_size)].long()
        k[b, :, :n] = k_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)
        v[b, :, :n] = v_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)
        qq[b, :, :q_len] = q[starts[b] : starts[b + 1]].transpose(0, 1)

    same_len = len({p + n for p, n in problem.seqs}) == 1
    all_prefill = all(p == 0 for p, _ in problem.seqs) and same_len
    all_decode = all(n == 1 for _, n in problem.seqs) and same_len
    mask = None
    if not (all_prefill or all_decode):
        key_pos = torch.arange(n_max, device=dev)
        lens = torch.tensor([p + n for p, n in problem.seqs], device=dev)
        q_lens = torch.tensor([n for _, n in problem.seqs], device=dev)
        query_pos = (lens - q_lens)[:, None] + torch.arange(l_max, device=dev)[None, :]  # (B, L)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # (B, L, N)
        mask = mask[:, None]  # (B, 1, L, N)
    group = num_heads // kv_heads
    enable_gqa = mask is None
    if group > 1 and not enable_gqa:
        # the masked (memory-efficient) SDPA kernels take no GQA: give them one K/V per query head
        k = k.repeat_interleave(group, 1)
        v = v.repeat_interleave(group, 1)

    def run() -> torch.Tensor:
        return F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, is_causal=all_prefill, enable_gqa=enable_gqa)

    return run
