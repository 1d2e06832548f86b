"""CPU tensors on 2 MiB pages where Linux lends them (transparent huge pages), for the weights the native
kernels stream.

A one-row GEMM reads each weight byte once, front to back, so its speed is the memory's. On 4 KiB pages
the hardware prefetchers stop at every page boundary and each page costs a TLB miss; on 2 MiB pages a
stream runs on. On a Zen 4 EPYC VM (2 threads, `bench/weight_pages.py`, `bench/RESULTS.md`), one-row
int4 and int8 GEMMs over weights far larger than the caches read 5-6% faster from 2 MiB pages in the
machine's slow-bandwidth mode and 8-9% faster in its fast one in one 5-minute run; 12% and 30% in an
earlier one (int4: 31.9 -> 35.7 and 45.5 -> 59.2 GB/s).

`empty(shape, dtype)` gives an uninitialised tensor in an anonymous mapping of its own, starting on a
2 MiB boundary, whose whole 2 MiB pages are advised `MADV_HUGEPAGE`; the last partial page stays on
4 KiB pages, so nothing resident lies outside the tensor's bytes (the mapping reserves 2 MiB more address
space to find the boundary, never touched, so never resident). The memory is returned when the last
tensor viewing it is freed.

A tensor under 2 MiB has no whole page of its own. Inside `packing()` (a model's load) such tensors are
carved one after another, 64-byte aligned, from shared regions of `REGION` bytes advised as a whole, so a
small model's projections and every model's scales stream from 2 MiB pages too: on the same VM a one-row
pass over the default model's (135M) projections, 0.3-1.1 MB each, ran 1.10-1.28x as fast so, and its
fused decoder step at one stream 1.11-1.28x. A
region is returned when the last tensor carved from it is freed; its last, part-filled 2 MiB page is
resident whole (at most 2 MiB a region beyond its tensors' bytes). Outside a packing, small tensors get
`torch.empty`'s memory.

`HELEXA_HUGEPAGES=off` and kernels whose THP mode is `never` get `torch.empty`'s memory throughout; where
the kernel has no huge page free at the first touch it uses 4 KiB pages, so the advice never fails an
allocation.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

import torch

__all__ = ["ENV", "HUGE_PAGE", "REGION", "empty", "enabled", "packing"]

ENV = "HELEXA_HUGEPAGES"
HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
REGION = 64 << 20  # bytes of address space a packing reserves at a time (resident only as it is filled)
_ALIGN = 64  # bytes: each packed tensor starts on a cache line
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def _kernel_lends() -> bool:
    """True when this Linux lends transparent huge pages to a mapping that asks (mode `always` or
    `madvise`, and `mmap.MADV_HUGEPAGE` exists)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def enabled() -> bool:
    """True when `empty` asks for huge pages: the kernel lends them and `HELEXA_HUGEPAGES` is not `off`."""
    return os.environ.get(ENV, "auto") != "off" and _kernel_lends()


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of `shape` and `dtype`, on 2 MiB pages where it can be (see
    the module doc): the same tensor `torch.empty` gives, but for where its memory lies."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not enabled() or nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if nbytes >= HUGE_PAGE:
        region, offset = _advised(nbytes)
    else:
        pack = _packing.get()
        if pack is None:
            return torch.empty(shape, dtype=dtype)
        region, offset = pack.take(nbytes)
    # the tensor holds `region` (torch.frombuffer keeps its buffer alive), so the mapping lives as long as it
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)


@contextlib.contextmanager
def packing() -> Iterator[None]:
    """Within it (in this thread or task), `empty` carves tensors under 2 MiB from shared regions on 2 MiB
    pages instead of giving them `torch.empty`'s memory (see the module doc). Tensors carved stay valid
    after it ends; its last region is then held by them alone."""
    token = _packing.set(_Packing())
    try:
        yield
    finally:
        _packing.reset(token)


class _Packing:
    """The region a `packing()` carves small tensors from: each in turn, aligned, until one does not fit
    in what is left; then a new region (the old one lives on in its tensors)."""

    def __init__(self) -> None:
        self._region: mmap.mmap | None = None
        self._next = self._end = 0  # offsets into the region: the next tensor's start, the usable end

    def take(self, nbytes: int) -> tuple[mmap.mmap, int]:
        """(region, offset) of `nbytes` (under `REGION`) that no other tensor uses, `_ALIGN`-aligned."""
        if self._region is None or self._next + nbytes > self._end:
            self._region, self._next = _advised(REGION)
            self._end = self._next + REGION
        offset = self._next
        self._next = offset + -(-nbytes // _ALIGN) * _ALIGN
        return self._region, offset


_packing: ContextVar[_Packing | None] = ContextVar("helexa_hugepages_packing", default=None)


def _advised(nbytes: int) -> tuple[mmap.mmap, int]:
    """A fresh anonymous mapping and the offset in it of `nbytes` starting on a 2 MiB boundary, advised
    `MADV_HUGEPAGE` over their whole 2 MiB pages (a region's `REGION` bytes are whole pages)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    offset = -base % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel that refuses the advice: 4 KiB pages, as torch.empty's
        pass
    return region, offset
