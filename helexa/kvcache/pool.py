"""The KV block pool: every layer's K and V cache, allocated once, plus the allocator of its blocks."""

from __future__ import annotations

import torch

from helexa.kvcache.allocator import AllocatorBackend, BlockAllocator, BlockIds
from helexa.kvcache.budget import kv_bytes_per_block

__all__ = ["BlockPool"]


class BlockPool:
    """The paged KV cache of a model: `num_layers` (k_cache, v_cache) pairs and the allocator of their blocks.

    Each cache is (num_blocks, block_size, num_kv_heads, head_dim) of `dtype`, zero-filled, allocated
    here once and never resized. A token's slot is `block_id * block_size + offset`. All `num_blocks`
    blocks are allocatable, so `num_blocks` is the exact capacity admission counts against.
    The allocator state lives on `device` (`backend`: see `BlockAllocator`); `kv_device` (default
    `device`) places only the K/V tensors: "meta" gives the real shapes without storage.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        backend: AllocatorBackend = "auto",
        kv_device: torch.device | str | None = None,
    ) -> None:
        # Bytes one block takes over all layers, K and V; validates the shape arguments and dtype.
        self.bytes_per_block = kv_bytes_per_block(block_size, num_layers, num_kv_heads, head_dim, dtype)
        self.block_size, self.num_layers = block_size, num_layers
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.allocator = BlockAllocator(num_blocks, device, backend)
        self.device = self.allocator.device
        self.kv_device = torch.device(kv_device) if kv_device is not None else self.device
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        caches = (torch.zeros(shape, dtype=dtype, device=self.kv_device) for _ in range(2 * num_layers))
        self._caches = list(zip(caches, caches))  # per layer (k_cache, v_cache), each (NB, BS, KVH, D)

    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool, all allocatable."""
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks now, exact, without a device sync."""
        return self.allocator.num_free_blocks

    @property
    def num_allocated_blocks(self) -> int:
        """Blocks holding at least one reference."""
        return self.allocator.num_allocated_blocks

    @property
    def backend(self) -> str:
        """The allocator implementation in use: "triton" or "torch"."""
        return self.allocator.backend

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s key cache, (num_blocks, block_size, num_kv_heads, head_dim)."""
        return self._caches[self._layer(layer)][0]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s value cache, (num_blocks, block_size, num_kv_heads, head_dim)."""
        return self._caches[self._layer(layer)][1]

    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (k_cache, v_cache) pair per layer, in layer order (a new list of the same tensors)."""
        return list(self._caches)

    def can_allocate(self, n: int) -> bool:
        """True when `allocate(n)` would succeed now."""
        return self.allocator.can_allocate(n)

    def allocate(self, n: int) -> torch.Tensor:
        """(n,) int32 ids of newly allocated blocks on `device`; `BlockAllocator.allocate`."""
        return self.allocator.allocate(n)

    def free(self, block_ids: BlockIds) -> None:
        """Release one reference per block; `BlockAllocator.free`."""
        self.allocator.free(block_ids)

    def incref(self, block_ids: BlockIds) -> None:
        """Add one reference per allocated block; `BlockAllocator.incref`."""
        self.allocator.incref(block_ids)

    def decref(self, block_ids: BlockIds) -> None:
        """Drop one reference per block; `BlockAllocator.decref`."""
        self.allocator.decref(block_ids)

    def refcount(self, block_id: int) -> int:
        """One block's reference count (host mirror, no sync)."""
        return self.allocator.refcount_of(block_id)

    def check_integrity(self) -> None:
        """Raise `RuntimeError` unless the allocator's invariants hold and the caches are intact."""
        self.allocator.check_integrity()
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        for layer, (k, v) in enumerate(self._caches):
            for name, t in (("k", k), ("v", v)):
                if tuple(t.shape) != shape or t.dtype != self.dtype or t.device != self.kv_device:
                    raise RuntimeError(f"layer {layer} {name} cache is {tuple(t.shape)} {t.dtype} on {t.device}")

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, num_layers={self.num_layers}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, device={self.device}, "
            f"backend={self.backend!r}, free={self.num_free_blocks})"
        )

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return layer
