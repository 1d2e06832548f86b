"""`KVBudget`: a KV pool's block count and every number that produced it (`helexa.kvcache.budget` computes it).

Plain numbers, no torch: the server's side of an engine core in its own process reads the core's budget.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KVBudget", "format_bytes"]


def format_bytes(num_bytes: int) -> str:
    """`num_bytes` as GiB (two decimals) from 1 GiB up, else as MiB (one decimal)."""
    return f"{num_bytes / (1 << 30):.2f}GiB" if abs(num_bytes) >= 1 << 30 else f"{num_bytes / (1 << 20):.1f}MiB"


@dataclass(frozen=True)
class KVBudget:
    """The block count of a KV pool and every number that produced it (`describe()` logs them).

    `source`: "num_blocks", "kv_cache_memory", "gpu_memory_utilization" (the CUDA budget) or
    "cpu_default". `available_bytes`, the most the pool may take, is
    `total_memory_bytes * memory_utilization - weight_bytes - activation_reserve_bytes - scale_bytes`
    (`scale_bytes`: an fp8 pool's scales, else 0).
    """

    device_type: str
    source: str
    num_blocks: int
    block_size: int
    bytes_per_block: int
    total_memory_bytes: int
    memory_utilization: float
    weight_bytes: int
    activation_reserve_bytes: int
    available_bytes: int
    requested_bytes: int
    scale_bytes: int = 0

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the pool takes: `num_blocks * bytes_per_block`."""
        return self.num_blocks * self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        """Tokens the pool holds: `num_blocks * block_size`."""
        return self.num_blocks * self.block_size

    @property
    def max_blocks(self) -> int:
        """The most blocks `available_bytes` allows."""
        return max(0, self.available_bytes) // self.bytes_per_block

    def describe(self) -> str:
        """One log line with the arithmetic, e.g. `kv budget: cuda total=80.00GiB x 0.90 - weights=15.00GiB -
        activations=1.20GiB = 55.80GiB available; gpu_memory_utilization -> 55.80GiB / 131072 B/block
        (16 tokens) = 457113 blocks (7313808 tokens, 55.80GiB)`."""
        return (
            f"kv budget: {self.device_type} total={format_bytes(self.total_memory_bytes)}"
            f" x {self.memory_utilization:.2f}"
            f" - weights={format_bytes(self.weight_bytes)} - activations={format_bytes(self.activation_reserve_bytes)}"
            + (f" - kv scales={self.scale_bytes}B" if self.scale_bytes else "")
            + f" = {format_bytes(self.available_bytes)} available;"
            f" {self.source} -> {format_bytes(self.requested_bytes)}"
            f" / {self.bytes_per_block} B/block ({self.block_size} tokens) = {self.num_blocks} blocks"
            f" ({self.num_tokens} tokens, {format_bytes(self.kv_cache_bytes)})"
        )
