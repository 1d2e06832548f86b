"""What a stored block's K/V depends on besides its tokens: the model's content, the KV dtype and the block shape."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

from helexa.kvcache.pool import BlockPool

__all__ = ["KVIdentity"]


@dataclass(frozen=True)
class KVIdentity:
    """The identity every block of a tier shares: `model_key` (a digest of the model's content and of anything
    that changes its K/V, such as load-time quantization), the KV `dtype` and the block's shape. A disk tier
    written under one identity is discarded when opened under another."""

    model_key: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of_pool(cls, pool: BlockPool, model_key: str) -> KVIdentity:
        """The identity of blocks read from `pool` for the model `model_key` (an fp8 pool's scales included: its
        bytes mean nothing under other scales)."""
        dtype = str(pool.dtype).removeprefix("torch.")
        if pool.kv_scales is not None:
            scales = pool.kv_scales.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
            model_key += "/scales:" + hashlib.sha256(scales).hexdigest()[:16]
        return cls(model_key, dtype, pool.block_size, pool.num_layers, pool.num_kv_heads, pool.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """(num_layers, 2, block_size, num_kv_heads, head_dim): one block's K then V over every layer."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        """Bytes of one block's K/V."""
        n = 1
        for d in self.block_shape:
            n *= d
        return n * torch.empty((), dtype=self.torch_dtype).element_size()

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @property
    def digest(self) -> bytes:
        """32 bytes: SHA-256 of the identity's canonical JSON; written in every disk block's header."""
        return hashlib.sha256(self.to_json().encode()).digest()
