"""Builders of random paged-attention problems for the kernel tests.

A problem is a batch of sequences, each given as (prefix_len, q_len): `prefix_len` tokens already
in the cache and `q_len` new query tokens whose K/V are also already written (so seq_lens
include the new tokens). Blocks are drawn from a shuffled pool so tables are scattered and
non-contiguous; cache rows past each sequence's end and unused table entries point at NaN so a
kernel that reads them fails the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Max |out - ref| / max |ref| allowed against the fp64 reference, per input dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclass
class PagedProblem:
    q: torch.Tensor  # (T, H, D)
    k_cache: torch.Tensor  # (NB, BS, KVH, D)
    v_cache: torch.Tensor  # (NB, BS, KVH, D)
    block_tables: torch.Tensor  # (B, MB) int32
    seq_lens: torch.Tensor  # (B,) int32
    query_start_loc: torch.Tensor  # (B+1,) int32

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc

    def args_fp64(self) -> tuple[torch.Tensor, ...]:
        return (self.q.double(), self.k_cache.double(), self.v_cache.double(), *self.args()[3:])


def make_problem(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    spare_blocks: int = 3,
    extra_table_cols: int = 2,
    device: str = "cpu",
) -> PagedProblem:
    """A random problem for `seqs` = [(prefix_len, q_len), ...] with scattered block tables."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(p + n) // block_size) for p, n in seqs]
    nan_block = 0  # every unused table entry points here
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_seq) + extra_table_cols
    table = torch.full((len(seqs), max_blocks), nan_block, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_cache[nan_block] = float("nan")
    v_cache[nan_block] = float("nan")
    for b, ((prefix, q_len), n) in enumerate(zip(seqs, blocks_per_seq)):
        mine = [ids.pop() for _ in range(n)]
        table[b, :n] = torch.tensor(mine, dtype=torch.int32)
        tail = (prefix + q_len) % block_size
        if tail:  # rows past the end of the last block are garbage in a real cache
            k_cache[mine[-1], tail:] = float("nan")
            v_cache[mine[-1], tail:] = float("nan")
    q_lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    seq_lens = torch.tensor([p + n for p, n in seqs], dtype=torch.int32)
    q = torch.randn((int(q_lens.sum()), num_heads, head_dim), generator=gen).to(dtype)
    return PagedProblem(*(t.to(device) for t in (q, k_cache, v_cache, table, seq_lens, query_start_loc)))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, NaN-propagating (NaN compares as failure)."""
    err = (out.double() - ref.double()).abs().max()
    return float(err / ref.double().abs().max())


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`helexa.kernels.linear` as it runs on CUDA (the Triton dense matmul), for a CPU tensor in the
    interpreter: what a test monkeypatches into the model's layers to run the CUDA step's arithmetic."""
    from helexa.kernels.dense_matmul import dense_matmul_triton

    y = dense_matmul_triton(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias
