"""helexa.kvcache: the paged KV block pool (`BlockPool`), its device-side allocator (`BlockAllocator`),
block tables and each step's `AttentionMetadata` (`BatchBuilder`), the prefix cache that shares full
blocks between requests (`PrefixCache`), the KV budget (`kv_budget`), and `KVManager`: the one owner of
who holds which block, which the engine and admission ask.
Importable without a model or a server."""

from __future__ import annotations

from typing import TYPE_CHECKING

from helexa.lazy import lazy_attributes

# Each name is imported from its module when first read: the budget's facts and the block states need no
# torch, the pool and its allocator do (the server's side of an engine core imports only the former).
_HOME = {
    "BlockAllocator": "helexa.kvcache.allocator",
    "OutOfBlocks": "helexa.kvcache.allocator",
    "BatchBuilder": "helexa.kvcache.batch",
    "BlockTable": "helexa.kvcache.batch",
    "CPU_DEFAULT_CAP": "helexa.kvcache.budget",
    "KVBudget": "helexa.kvcache.budget_record",
    "estimate_activation_bytes": "helexa.kvcache.budget",
    "kv_budget": "helexa.kvcache.budget",
    "kv_bytes_per_block": "helexa.kvcache.budget",
    "kv_scale_bytes": "helexa.kvcache.budget",
    "HoldingView": "helexa.kvcache.survey",
    "KVManager": "helexa.kvcache.manager",
    "KVSurvey": "helexa.kvcache.survey",
    "AttentionMetadata": "helexa.kvcache.metadata",
    "FP8_SCALE_MARGIN": "helexa.kvcache.pool",
    "BlockPool": "helexa.kvcache.pool",
    "LayerKV": "helexa.kvcache.pool",
    "fp8_scales": "helexa.kvcache.pool",
    "CachedBlock": "helexa.kvcache.prefix",
    "CacheSurvey": "helexa.kvcache.survey",
    "PrefixCache": "helexa.kvcache.prefix",
    "PrefixHit": "helexa.kvcache.prefix",
    "block_hash": "helexa.kvcache.prefix",
    "root_hash": "helexa.kvcache.prefix",
    "BlockStates": "helexa.kvprotocol",
    "parse_size": "helexa.values",
}

if TYPE_CHECKING:
    from helexa.kvcache.allocator import BlockAllocator, OutOfBlocks
    from helexa.kvcache.batch import BatchBuilder, BlockTable
    from helexa.kvcache.budget import (
        CPU_DEFAULT_CAP,
        estimate_activation_bytes,
        kv_budget,
        kv_bytes_per_block,
        kv_scale_bytes,
    )
    from helexa.kvcache.budget_record import KVBudget
    from helexa.kvcache.manager import KVManager
    from helexa.kvcache.metadata import AttentionMetadata
    from helexa.kvcache.pool import FP8_SCALE_MARGIN, BlockPool, LayerKV, fp8_scales
    from helexa.kvcache.prefix import CachedBlock, PrefixCache, PrefixHit, block_hash, root_hash
    from helexa.kvcache.survey import CacheSurvey, HoldingView, KVSurvey
    from helexa.kvprotocol import BlockStates
    from helexa.values import parse_size


__getattr__ = lazy_attributes(__name__, _HOME)


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
