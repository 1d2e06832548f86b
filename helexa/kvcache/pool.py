"""The KV block pool: every layer's K and V cache, allocated once, plus the allocator of its blocks."""

from __future__ import annotations

import torch

from helexa.kernels import FP8_KV_DTYPE, FP8_KV_MAX
from helexa.kvcache.allocator import AllocatorBackend, BlockAllocator, BlockIds, resolve_device
from helexa.kvcache.budget import kv_bytes_per_block

__all__ = ["FP8_SCALE_MARGIN", "BlockPool", "LayerKV", "fp8_scales"]

# An fp8 scale maps this multiple of the calibrated |x| max to 448: K/V up to 2x larger than any
# seen at calibration still fit (beyond that they saturate), at no cost in relative precision
# (e4m3 has 3 mantissa bits in every normal binade) and one binade less of small values.
FP8_SCALE_MARGIN = 2.0


def fp8_scales(amax: torch.Tensor, margin: float = FP8_SCALE_MARGIN) -> torch.Tensor:
    """float32 scales for values whose largest magnitude is `amax` (any shape): `amax * margin / 448`,
    or 1.0 where `amax` is 0 (or not finite): nothing seen, nothing to fit."""
    amax = amax.to(torch.float32)
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, amax * (margin / FP8_KV_MAX), torch.ones_like(amax))


class LayerKV(tuple[torch.Tensor, torch.Tensor]):
    """One layer's `(k_cache, v_cache)`: a pair (unpacks as one) that also carries the keyword arguments
    the kernels take with these caches: `scales` is `{"k_scale": (KVH,), "v_scale": (KVH,)}` float32
    for an fp8 pool (views of the pool's scales, so calibration updates them in place), else `{}`:

        write_kv(k, v, *kv, slot_mapping, **kv.scales)
    """

    scales: dict[str, torch.Tensor]

    def __new__(
        cls,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> LayerKV:
        pair = super().__new__(cls, (k_cache, v_cache))
        pair.scales = {} if k_scale is None or v_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        return pair


class BlockPool:
    """The paged KV cache of a model: `num_layers` (k_cache, v_cache) pairs and the allocator of their blocks.

    Each cache is (num_blocks, block_size, num_kv_heads, head_dim) of `dtype`, zero-filled, allocated
    here once and never resized. An fp8 pool (`dtype=torch.float8_e4m3fn`) also holds `kv_scales`,
    (num_layers, 2, num_kv_heads) float32 (K then V), 1.0 until `set_kv_scales`. A token's slot is
    `block_id * block_size + offset`. All `num_blocks` blocks are allocatable, so `num_blocks` is the
    exact capacity admission counts against. The allocator state lives on `device` (`backend`: see
    `BlockAllocator`); `kv_device` (default `device`) places only the K/V tensors (and an fp8 pool's
    scales): "meta" gives the real shapes without storage.
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
        self.kv_device = resolve_device(kv_device) if kv_device is not None else self.device
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        caches = (torch.zeros(shape, dtype=dtype, device=self.kv_device) for _ in range(2 * num_layers))
        self._caches = list(zip(caches, caches))  # per layer (k_cache, v_cache), each (NB, BS, KVH, D)
        self.kv_scales: torch.Tensor | None = None  # (L, 2, KVH) float32 for fp8 pools
        if dtype == FP8_KV_DTYPE:
            self.kv_scales = torch.ones((num_layers, 2, num_kv_heads), dtype=torch.float32, device=self.kv_device)
            scales = [(s[0], s[1]) for s in self.kv_scales]  # views
            self._layers = [LayerKV(k, v, *s) for (k, v), s in zip(self._caches, scales)]
        else:
            self._layers = [LayerKV(k, v) for k, v in self._caches]

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

    def kv_caches(self) -> list[LayerKV]:
        """One (k_cache, v_cache) pair per layer, in layer order (a new list of the same tensors); each a
        `LayerKV`, whose `scales` an fp8 pool's attention calls pass on."""
        return list(self._layers)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block's K/V over every layer, as `read_blocks` returns it: (num_layers, 2, block_size, num_kv_heads,
        head_dim), K then V."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks' K/V: (n, num_layers, 2, block_size, num_kv_heads, head_dim) of the pool's dtype,
        on the host (pinned when the pool is on CUDA), in `block_ids` order. Reads whatever the blocks hold."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.kv_device)
        layers = [torch.stack((k.index_select(0, idx), v.index_select(0, idx)), 1) for k, v in self._caches]
        out = torch.stack(layers, 1)  # (n, L, 2, BS, KVH, D)
        if out.device.type == "cpu":
            return out
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out)
        return host

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Overwrite the blocks' K/V with `data` (n, num_layers, 2, block_size, num_kv_heads, head_dim) of the pool's
        dtype, as `read_blocks` gave it. `ValueError` (writing nothing) for another shape or dtype."""
        want = (len(block_ids), *self.block_shape)
        if tuple(data.shape) != want or data.dtype != self.dtype:
            raise ValueError(
                f"write_blocks: data must be {list(want)} {self.dtype}, got {list(data.shape)} {data.dtype}"
            )
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.kv_device)
        data = data.to(self.kv_device, non_blocking=True)
        for layer, (k, v) in enumerate(self._caches):
            k.index_copy_(0, idx, data[:, layer, 0])
            v.index_copy_(0, idx, data[:, layer, 1])

    @property
    def quantized(self) -> bool:
        """True for an fp8 pool (its caches need `kv_scales`)."""
        return self.kv_scales is not None

    def set_kv_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Set an fp8 pool's scales in place: `k_scale`, `v_scale` (num_layers, num_kv_heads), finite and
        > 0 (e.g. `fp8_scales(amax)`). Blocks written before keep the scales they were written with, so
        call it before any K/V is written. ValueError for another pool or bad scales."""
        if self.kv_scales is None:
            raise ValueError(f"set_kv_scales applies to an fp8 pool, not {self.dtype}")
        want = (self.num_layers, self.num_kv_heads)
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must be {list(want)}, got {tuple(t.shape)}")
            if self.kv_device.type != "meta" and not bool((torch.isfinite(t) & (t > 0)).all()):
                raise ValueError(f"{name} must be finite and > 0, got {t.tolist()}")
        self.kv_scales.copy_(torch.stack((k_scale, v_scale), dim=1))

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
        if self.kv_scales is not None and self.kv_device.type != "meta":
            if not bool((torch.isfinite(self.kv_scales) & (self.kv_scales > 0)).all()):
                raise RuntimeError(f"fp8 scales must be finite and > 0, got {self.kv_scales.tolist()}")

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
