"""helexa.kvcache: the paged KV block pool, its device-side allocator, block tables, the KV budget.

Importable without a model or a server. Modules: `pool` (BlockPool: every layer's K/V cache,
allocated once), `allocator` (BlockAllocator, OutOfBlocks: free stack and refcounts on the device,
exact host mirror), `batch` (BlockTable, BatchBuilder: grow tables each step, build
AttentionMetadata), `metadata` (AttentionMetadata), `budget` (kv_budget, KVBudget: the block count).
"""

from helexa.config import parse_size
from helexa.kvcache.allocator import BlockAllocator, OutOfBlocks
from helexa.kvcache.batch import BatchBuilder, BlockTable
from helexa.kvcache.budget import CPU_DEFAULT_CAP, KVBudget, estimate_activation_bytes, kv_budget, kv_bytes_per_block
from helexa.kvcache.metadata import AttentionMetadata
from helexa.kvcache.pool import BlockPool

__all__ = [
    "AttentionMetadata",
    "BatchBuilder",
    "BlockAllocator",
    "BlockPool",
    "BlockTable",
    "CPU_DEFAULT_CAP",
    "KVBudget",
    "OutOfBlocks",
    "estimate_activation_bytes",
    "kv_budget",
    "kv_bytes_per_block",
    "parse_size",
]
