"""helexa.kvcache.tiers: where KV blocks go when the pool evicts them, and come back from — host memory
(`HostTier`) and disk (`DiskTier`), each with its own LRU and byte budget, behind `KVTiers`, which only
the KV owner (`KVManager`) calls."""

from helexa.kvcache.tiers.disk import DiskTier
from helexa.kvcache.tiers.host import HostTier, TierCounters
from helexa.kvcache.tiers.identity import KVIdentity
from helexa.kvcache.tiers.index import TierBlock, TierIndex
from helexa.kvcache.tiers.stack import KVTiers, TierHit, TierListener, TierStats

__all__ = [
    "DiskTier",
    "HostTier",
    "KVIdentity",
    "KVTiers",
    "TierBlock",
    "TierCounters",
    "TierHit",
    "TierIndex",
    "TierListener",
    "TierStats",
]
