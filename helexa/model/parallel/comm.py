"""The collectives a sharded model calls inside its forward: all-reduce and gather to rank 0.

`TensorParallel` is held by the modules that communicate (row-parallel linears, the vocab-parallel
embedding, the output head); it wraps the default `torch.distributed` group, which
`helexa.engine.parallel.group` sets up. Every rank calls the same collectives in the same order, because
every rank runs the same forward over the same step inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helexa.model.parallel.sharding import ShardPlan

__all__ = ["RowParallelLinear", "TensorParallel", "VocabParallelEmbedding"]


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group: `plan` says what it holds.

    `size == 1` never communicates (the single-device model uses none of the classes below).
    """

    plan: ShardPlan

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def size(self) -> int:
        return self.plan.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` (any shape) over the ranks, in place; returns `x`."""
        dist.all_reduce(x)
        return x

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """The full-vocabulary logits `(S, V)` on rank 0 from every rank's `(S, vocab_rows)` shard; an
        empty `(S, 0)` on the other ranks. Shards are padded to `vocab_shard` columns for the gather,
        then cut back. With `S == 0` nothing is exchanged (every rank has the same S)."""
        plan = self.plan
        rows = local.shape[0]
        if rows == 0:
            return local.new_empty((0, plan.vocab_size if plan.rank == 0 else 0))
        if local.shape[1] < plan.vocab_shard:
            local = F.pad(local, (0, plan.vocab_shard - local.shape[1]))  # (S, vocab_shard)
        local = local.contiguous()
        if plan.rank != 0:
            dist.gather(local, None, dst=0)
            return local.new_empty((rows, 0))
        parts = [torch.empty_like(local) for _ in range(plan.size)]
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=1)[:, : plan.vocab_size].reshape(rows, plan.vocab_size)  # (S, V)


class RowParallelLinear(nn.Module):
    """`y = all_reduce(x @ W_r^T) + b`: `weight` is this rank's `(out, in / size)` column slice, `bias`
    the whole `(out,)`, added once after the sum so every rank holds the same full output."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # (out, in_local)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None  # (out,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, in_local) -> (T, out), identical on every rank."""
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by rows: `weight` holds ids `[vocab_start, vocab_end)`; other ids look
    up zeros here, and the all-reduce adds the one rank's row that holds each id (exactly: x + 0)."""

    def __init__(self, embedding_dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.end = tp.plan.vocab_start, tp.plan.vocab_end
        self.weight = nn.Parameter(torch.empty(tp.plan.vocab_rows, embedding_dim))  # (V_local, E)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: (T,) int64 in [0, V) -> (T, E), identical on every rank."""
        mine = (ids >= self.start) & (ids < self.end)  # (T,)
        if self.weight.shape[0] == 0:  # more ranks than vocabulary shards: this one holds no rows
            out = self.weight.new_zeros((ids.shape[0], self.weight.shape[1]))
        else:
            local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
            out = F.embedding(local, self.weight) * mine[:, None].to(self.weight.dtype)  # (T, E)
        return self.tp.all_reduce(out)
