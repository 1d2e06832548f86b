"""The KV block pool: every layer's K and V cache, allocated once, plus the allocator of its blocks."""

from __future__ import annotations

import torch

from helexa.kvcache.allocator import AllocatorBackend, BlockAllocator, BlockIds

__all__ = ["BlockPool"]


def _positive(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class BlockPool:
    """The whole paged KV cache of a model: `num_layers` pairs of (k_cache, v_cache) and their blocks.

    Each cache is `[num_blocks, block_size, num_kv_heads, head_dim]` of `dtype`, zero-filled,
    allocated once here and never grown, shrunk or reallocated. A token's *slot* is
    `block_id * block_size + offset`. All `num_blocks` blocks are allocatable (block 0 is not
    reserved; see `helexa.kvcache.allocator`), so `num_blocks` is the exact capacity admission
    counts against.

    The allocator state lives on `device`; `backend` picks its implementation ("auto": Triton
    kernels on CUDA, torch ops elsewhere; "triton" on CPU needs `TRITON_INTERPRET=1`).
    `kv_device` (default `device`) places only the K/V tensors: pass "meta" for a pool with the
    real shapes and no storage (planning, tests of very large pools), the allocator still runs.
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
        self.block_size = _positive(block_size, "block_size")
        self.num_layers = _positive(num_layers, "num_layers")
        self.num_kv_heads = _positive(num_kv_heads, "num_kv_heads")
        self.head_dim = _positive(head_dim, "head_dim")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.allocator = BlockAllocator(_positive(num_blocks, "num_blocks"), device, backend)
        self.device = self.allocator.device
        self.kv_device = torch.device(kv_device) if kv_device is not None else self.device
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=dtype, device=self.kv_device),  # (NB, BS, KVH, D)
                torch.zeros(shape, dtype=dtype, device=self.kv_device),  # (NB, BS, KVH, D)
            )
            for _ in range(num_layers)
        ]

    # ---------------------------------------------------------------- sizes

    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool, all allocatable."""
        return self.allocator.num_blocks

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over all layers, K and V: 2 * L * BS * KVH * D * itemsize."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

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

    # ---------------------------------------------------------------- caches

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s key cache, (num_blocks, block_size, num_kv_heads, head_dim)."""
        return self._caches[self._layer(layer)][0]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s value cache, (num_blocks, block_size, num_kv_heads, head_dim)."""
        return self._caches[self._layer(layer)][1]

    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (k_cache, v_cache) pair per layer, in layer order (a new list of the same tensors)."""
        return list(self._caches)

    # ---------------------------------------------------------------- allocation (see BlockAllocator)

    def can_allocate(self, n: int) -> bool:
        """True when `allocate(n)` would succeed now."""
        return self.allocator.can_allocate(n)

    def allocate(self, n: int) -> torch.Tensor:
        """(n,) int32 ids of newly allocated blocks on `device`; raises `OutOfBlocks` (nothing taken)."""
        return self.allocator.allocate(n)

    def free(self, block_ids: BlockIds) -> None:
        """Release one reference per block; raises `ValueError` (nothing changed) on a bad id."""
        self.allocator.free(block_ids)

    def incref(self, block_ids: BlockIds) -> None:
        """Add one reference per allocated block."""
        self.allocator.incref(block_ids)

    def decref(self, block_ids: BlockIds) -> None:
        """Drop one reference per block; blocks at zero return to the free stack."""
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
