"""helexa.kvcache: the paged KV block pool (`BlockPool`), its device-side allocator (`BlockAllocator`),
block tables and each step's `AttentionMetadata` (`BatchBuilder`), the prefix cache that shares full
blocks between requests (`PrefixCache`), the KV budget (`kv_budget`), and `KVManager`: the one owner of
who holds which block, which the engine and admission ask.
Importable without a model or a server."""

from helexa.kvcache.allocator import BlockAllocator, OutOfBlocks
from helexa.kvcache.batch import BatchBuilder, BlockTable
from helexa.kvcache.budget import (
    CPU_DEFAULT_CAP,
    KVBudget,
    estimate_activation_bytes,
    kv_budget,
    kv_bytes_per_block,
    kv_scale_bytes,
)
from helexa.kvcache.manager import HoldingView, KVManager, KVSurvey
from helexa.kvcache.metadata import AttentionMetadata
from helexa.kvcache.pool import FP8_SCALE_MARGIN, BlockPool, LayerKV, fp8_scales
from helexa.kvcache.prefix import CachedBlock, CacheSurvey, PrefixCache, PrefixHit, block_hash, root_hash
from helexa.kvprotocol import BlockStates
from helexa.values import parse_size

__all__ = [
    "AttentionMetadata",
    "BatchBuilder",
    "BlockAllocator",
    "BlockStates",
    "HoldingView",
    "KVManager",
    "KVSurvey",
    "BlockPool",
    "BlockTable",
    "CPU_DEFAULT_CAP",
    "FP8_SCALE_MARGIN",
    "CacheSurvey",
    "CachedBlock",
    "KVBudget",
    "LayerKV",
    "OutOfBlocks",
    "PrefixCache",
    "PrefixHit",
    "block_hash",
    "estimate_activation_bytes",
    "fp8_scales",
    "kv_budget",
    "kv_bytes_per_block",
    "kv_scale_bytes",
    "parse_size",
    "root_hash",
]
