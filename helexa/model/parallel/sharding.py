"""Which slice of every weight a tensor-parallel rank keeps (Megatron sharding), as plain arithmetic.

For `N` ranks and rank `r` of a decoder-only model with `H` query heads, `KVH` KV heads, head size
`D`, MLP width `I` and vocabulary `V`:

- q/k/v and gate/up are column-parallel: rank `r` keeps query heads `[r*H/N, (r+1)*H/N)`, its KV
  heads (below) and MLP rows `[r*I/N, (r+1)*I/N)`; o_proj and down_proj are row-parallel (the same
  ranges of their input columns), each followed by one all-reduce.
- KV heads: when `N` divides `KVH`, rank `r` keeps `KVH/N` of them; when `KVH` divides `N` (more
  ranks than KV heads), each rank keeps one KV head, replicated on `N/KVH` ranks (as vLLM does);
  otherwise the model is refused with a message that names the sizes that would work.
- The embedding and the output head are vocab-parallel: rank `r` keeps rows
  `[r*ceil(V/N), min((r+1)*ceil(V/N), V))`; the last shard may be shorter (or empty).
- Norms (and Qwen3's per-head q/k norms) and the row-parallel biases are replicated.

`ShardPlan.for_model(config, rank, size)` checks the sizes and gives every number; with `size=1`
every range is the whole tensor, so the single-device model is the same code with a trivial plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # helexa.model imports this package (the transformer's sharded layers)
    from helexa.model.config import ModelConfig

__all__ = ["ShardPlan", "check_tensor_parallel"]

_ROW = ("self_attn.o_proj", "mlp.down_proj")  # row-parallel: split along their input columns


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise `ValueError` unless `config` can be split over `size` ranks: `size` divides the query
    heads and the MLP width, and `size` divides the KV heads or is a multiple of them. The message
    names the model's sizes and the tensor-parallel sizes that work."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    problems = []
    if heads % size:
        problems.append(f"its {heads} attention heads are not divisible by {size}")
    if kv_heads % size and size % kv_heads:
        problems.append(
            f"its {kv_heads} KV heads are neither divisible by {size} nor a divisor of it (to be replicated)"
        )
    if inter % size:
        problems.append(f"its MLP width {inter} is not divisible by {size}")
    if problems:
        ok = [n for n in _divisors(heads) if inter % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]
        raise ValueError(
            f"--tensor-parallel-size {size} cannot shard {config.architecture}: {'; '.join(problems)}. "
            f"Sizes that work for this model: {', '.join(map(str, ok))}"
        )


@dataclass(frozen=True)
class ShardPlan:
    """The part of the model rank `rank` of `size` holds; every range is `[start, start + count)`.

    `num_heads`, `num_kv_heads`: query and KV heads on this rank (GQA still holds: `num_heads` is a
    multiple of `num_kv_heads`); `kv_head_start`: the first of its KV heads in the checkpoint;
    `kv_replicas`: ranks holding each KV head (1 unless KV heads are replicated).
    """

    rank: int
    size: int
    head_dim: int
    num_heads: int
    head_start: int
    num_kv_heads: int
    kv_head_start: int
    kv_replicas: int
    intermediate_size: int
    intermediate_start: int
    vocab_size: int  # of the whole model
    vocab_shard: int  # ceil(vocab_size / size): rows of every shard once padded (the gather's width)
    vocab_start: int
    vocab_end: int

    @classmethod
    def for_model(cls, config: ModelConfig, rank: int = 0, size: int = 1) -> ShardPlan:
        """The plan of `rank` in a group of `size`; `ValueError` as `check_tensor_parallel`, or for a bad rank."""
        check_tensor_parallel(config, size)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"rank must be an int in [0, {size}), got {rank!r}")
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if kv_heads % size == 0:
            local_kv, kv_start, replicas = kv_heads // size, rank * (kv_heads // size), 1
        else:  # more ranks than KV heads: one KV head per rank, each on size // kv_heads ranks
            replicas = size // kv_heads
            local_kv, kv_start = 1, rank // replicas
        inter = config.intermediate_size // size
        shard = -(-config.vocab_size // size)
        v0 = min(rank * shard, config.vocab_size)
        return cls(
            rank=rank,
            size=size,
            head_dim=config.head_dim,
            num_heads=heads // size,
            head_start=rank * (heads // size),
            num_kv_heads=local_kv,
            kv_head_start=kv_start,
            kv_replicas=replicas,
            intermediate_size=inter,
            intermediate_start=rank * inter,
            vocab_size=config.vocab_size,
            vocab_shard=shard,
            vocab_start=v0,
            vocab_end=min(v0 + shard, config.vocab_size),
        )

    @property
    def q_size(self) -> int:
        """Rows of this rank's query projection: `num_heads * head_dim`."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of this rank's key (and value) projection: `num_kv_heads * head_dim`."""
        return self.num_kv_heads * self.head_dim

    @property
    def vocab_rows(self) -> int:
        """Embedding and output-head rows this rank holds: `vocab_end - vocab_start` (at most `vocab_shard`)."""
        return self.vocab_end - self.vocab_start

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | None:
        """`(dim, start, stop)` of checkpoint tensor `name` that this rank keeps, or None for the whole
        tensor (replicated, or `size == 1`). Only the rows or columns named are read from the file."""
        if self.size == 1:
            return None
        module, _, leaf = name.rpartition(".")
        owner = ".".join(module.split(".")[-2:])
        if module in ("model.embed_tokens", "lm_head"):
            return (0, self.vocab_start, self.vocab_end)
        d = self.head_dim
        if owner == "self_attn.q_proj":
            return (0, self.head_start * d, (self.head_start + self.num_heads) * d)
        if owner in ("self_attn.k_proj", "self_attn.v_proj"):
            return (0, self.kv_head_start * d, (self.kv_head_start + self.num_kv_heads) * d)
        if owner in ("mlp.gate_proj", "mlp.up_proj"):
            return (0, self.intermediate_start, self.intermediate_start + self.intermediate_size)
        if owner in _ROW and leaf == "weight":  # their bias is added once, after the all-reduce
            if owner == "self_attn.o_proj":
                return (1, self.head_start * d, (self.head_start + self.num_heads) * d)
            return (1, self.intermediate_start, self.intermediate_start + self.intermediate_size)
        return None

    def describe(self) -> str:
        """One line: what this rank holds."""
        replicated = f" (each on {self.kv_replicas} ranks)" if self.kv_replicas > 1 else ""
        return (
            f"rank {self.rank}/{self.size}: heads [{self.head_start}, {self.head_start + self.num_heads}) "
            f"kv heads [{self.kv_head_start}, {self.kv_head_start + self.num_kv_heads}){replicated} "
            f"mlp [{self.intermediate_start}, {self.intermediate_start + self.intermediate_size}) "
            f"vocab [{self.vocab_start}, {self.vocab_end})"
        )
