"""helexa.kvcache: the paged KV block pool, its device-side allocator, block tables, the KV budget.

Importable without a model or a server. Module map:
    pool.py       BlockPool — every layer's K/V cache, allocated once, and its blocks
    allocator.py  BlockAllocator, OutOfBlocks — free stack + refcounts on the device, exact host mirror
    batch.py      BlockTable, BatchBuilder — grow tables each step, build AttentionMetadata
    metadata.py   AttentionMetadata — the per-step attention inputs
    budget.py     kv_budget, KVBudget, parse_size — the deterministic block count
"""

from helexa.kvcache.allocator import BlockAllocator, OutOfBlocks
from helexa.kvcache.batch import BatchBuilder, BlockTable
from helexa.kvcache.budget import (
    CPU_DEFAULT_CAP,
    CPU_DEFAULT_FRACTION,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    KVBudget,
    estimate_activation_bytes,
    kv_budget,
    kv_bytes_per_block,
    parse_size,
)
from helexa.kvcache.metadata import AttentionMetadata
from helexa.kvcache.pool import BlockPool

__all__ = [
    "AttentionMetadata",
    "BatchBuilder",
    "BlockAllocator",
    "BlockPool",
    "BlockTable",
    "CPU_DEFAULT_CAP",
    "CPU_DEFAULT_FRACTION",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "KVBudget",
    "OutOfBlocks",
    "estimate_activation_bytes",
    "kv_budget",
    "kv_bytes_per_block",
    "parse_size",
]
