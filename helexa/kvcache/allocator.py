"""The block allocator: a free stack and reference counts on the device, mirrored exactly on the host.

The per-step kernels read and write the device state (see `helexa.kernels.block_alloc`), so a
decode step never waits for the host. The operations are deterministic, so the host mirror knows
every outcome: `num_free_blocks` is exact without a sync, and every request is validated on the
mirror before any state changes. Debug mode (`HELEXA_DEBUG=1`) compares the device free count with
the mirror after every operation. Block 0 is not reserved (table padding is never read; unwritten
tokens get slot -1). Not thread-safe.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Literal

import torch

from helexa.kernels import block_alloc
from helexa.values import check_int, debug_enabled

__all__ = ["AllocatorBackend", "BlockAllocator", "BlockIds", "OutOfBlocks", "resolve_device"]

AllocatorBackend = Literal["auto", "triton", "torch"]
BlockIds = Iterable[int] | torch.Tensor


def resolve_device(device: torch.device | str) -> torch.device:
    """`device` as the tensors made on it report theirs: "cuda" becomes "cuda:N" (the current device), so
    a pool's device compares equal to its caches' (torch.device("cuda") != torch.device("cuda:0")). Other
    devices are returned as given; resolving "cuda" initialises CUDA."""
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return resolved


class OutOfBlocks(RuntimeError):
    """An allocation asked for more blocks than are free; nothing was allocated. Attributes: the
    `requested`, `free` and `total` block counts at the time of the request."""

    def __init__(self, requested: int, free: int, total: int) -> None:
        super().__init__(f"out of KV blocks: requested {requested}, free {free}, total {total}")
        self.requested, self.free, self.total = requested, free, total

    def __reduce__(self) -> tuple:  # keep the numbers across pickling
        return (OutOfBlocks, (self.requested, self.free, self.total))


def _use_triton(backend: str, device: torch.device) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"allocator backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend != "triton":
        return backend == "auto" and device.type == "cuda"
    if block_alloc.TRITON_MISSING:
        raise ValueError(block_alloc.TRITON_MISSING)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError(
            f"allocator backend 'triton' on {device.type} needs TRITON_INTERPRET=1 (set before triton "
            "is imported); use backend 'torch' or 'auto' instead"
        )
    return True


class BlockAllocator:
    """Block ids in `[0, num_blocks)` with reference counts; `backend` "triton", "torch" or "auto"
    (Triton on CUDA, else torch).

    Guarantees (checked by `check_integrity`): every block is either on the free stack with
    refcount 0 or allocated with refcount >= 1, never both, never twice on the stack; the device
    state equals the mirror. A fresh allocator hands out 0, 1, 2, ...; freed blocks go on top of
    the stack and are handed out first.
    """

    def __init__(self, num_blocks: int, device: torch.device | str, backend: AllocatorBackend = "auto") -> None:
        check_int(num_blocks, "num_blocks")
        if num_blocks >= 2**31:
            raise ValueError(f"num_blocks must be < 2**31 (block ids are int32), got {num_blocks}")
        self.device = resolve_device(device)
        if self.device.type == "meta":
            raise ValueError("the allocator needs a real device; put only the K/V tensors on 'meta'")
        self.use_triton = _use_triton(backend, self.device)
        self.backend = "triton" if self.use_triton else "torch"
        self.num_blocks = num_blocks
        # Host mirror: `_free[-1]` is popped first; `_refs[i]` counts references to block i.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs: list[int] = [0] * num_blocks
        self._ever_allocated = bytearray(num_blocks)  # tells "double free" from "never allocated"
        # Device state, identical to the mirror.
        self.stack = torch.arange(num_blocks - 1, -1, -1, dtype=torch.int32, device=self.device)  # (NB,)
        self.refcount = torch.zeros(num_blocks, dtype=torch.int32, device=self.device)  # (NB,)
        self.top_counter = torch.full((1,), num_blocks, dtype=torch.int32, device=self.device)  # (1,)

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free stack now: exact, from the host mirror (no device sync)."""
        return len(self._free)

    @property
    def num_allocated_blocks(self) -> int:
        """Blocks with at least one reference: `num_blocks - num_free_blocks`."""
        return self.num_blocks - len(self._free)

    def refcount_of(self, block_id: int) -> int:
        """One block's reference count, from the host mirror (0 = free)."""
        self._check_range(block_id)
        return self._refs[block_id]

    def free_block_ids(self) -> list[int]:
        """The free stack, copied at one instant from the host mirror (no device sync): the last id is
        handed out first. A read-only view for display; it never changes the allocator."""
        return list(self._free)

    def can_allocate(self, n: int) -> bool:
        """True when `allocate(n)` would succeed now."""
        return check_int(n, "n", 0) <= len(self._free)

    def allocate(self, n: int) -> torch.Tensor:
        """Take `n` free blocks, each with reference count 1: their ids as an (n,) int32 tensor on the
        device. Raises `OutOfBlocks` when n exceeds the free count, `ValueError` for a bad n
        (nothing taken either way). No synchronisation."""
        with self._popping("allocate", n) as (_, top):
            return block_alloc.pop_blocks(self, top, n)

    def free(self, block_ids: BlockIds) -> None:
        """Drop one reference from each block (distinct ids); a block reaching zero becomes free, pushed
        in the order given. Raises `ValueError`, changing nothing, for an id out of range, a free block
        (double free or never allocated) or a repeated id. Host ids (list, CPU tensor) avoid a sync;
        a device tensor is read on the host to validate it."""
        self._release(block_ids, "free")

    def decref(self, block_ids: BlockIds) -> None:
        """The same operation as `free`, named for shared blocks."""
        self._release(block_ids, "decref")

    def incref(self, block_ids: BlockIds) -> None:
        """Add one reference to each allocated block (to share it). Raises `ValueError`, changing
        nothing, for an id out of range, a free block or a repeated id."""
        ids = self._host_ids(block_ids, "incref")
        for b in ids:
            if self._refs[b] == 0:
                raise ValueError(f"incref: block {b} is free; only allocated blocks can be shared")
        for b in ids:
            self._refs[b] += 1
        if ids:
            block_alloc.incref_blocks(self, self._device_ids(ids))
        self._debug_check("incref")

    def check_integrity(self) -> None:
        """Raise `RuntimeError` unless every invariant holds on the mirror and the device state equals
        it (stack, free count, reference counts). Synchronises with the device."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise RuntimeError("allocator: a block is on the free stack twice")
        if any(r < 0 for r in self._refs):
            raise RuntimeError("allocator: negative reference count")
        allocated = [b for b, r in enumerate(self._refs) if r > 0]
        if both := sorted(free_set.intersection(allocated)):
            raise RuntimeError(f"allocator: blocks both free and allocated: {both[:8]}")
        if len(free_set) + len(allocated) != self.num_blocks:
            raise RuntimeError(
                f"allocator: free {len(free_set)} + allocated {len(allocated)} != total {self.num_blocks}"
            )
        self._debug_check("check_integrity", always=True)
        if self.stack[: len(self._free)].tolist() != self._free:
            raise RuntimeError("allocator: device free stack differs from the host mirror")
        if self.refcount.tolist() != self._refs:
            raise RuntimeError("allocator: device reference counts differ from the host mirror")

    def extend_tables(
        self,
        total_new: int,
        tables: torch.Tensor,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        alloc_start: torch.Tensor,
        width: int,
        num_tokens: int,
        block_size: int,
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Pop `total_new` blocks into block-table rows and emit a step's tables and slots (arguments as
        `helexa.kernels.block_alloc.extend_tables`). Returns the popped ids in pop order (a host list),
        `block_tables` (B, width) int32 and `slot_mapping` (num_tokens,) int64 on the device. Raises
        `OutOfBlocks`, changing nothing, when total_new exceeds the free count."""
        with self._popping("extend", total_new) as (popped, top):
            out_tables, slots = block_alloc.extend_tables(
                self, top, total_new, tables, rows, seq_lens, query_start_loc, alloc_start, width, num_tokens,
                block_size,
            )  # fmt: skip
        return popped, out_tables, slots

    @contextlib.contextmanager
    def _popping(self, op: str, n: int) -> Iterator[tuple[list[int], int]]:
        """Validate and pop `n` ids on the mirror; yield them (first popped first) and the free count
        before, for the device pop in the body. A ValueError from the body (argument checks, raised
        before the device state changes) undoes the mirror."""
        free = len(self._free)
        if check_int(n, "n", 0) > free:
            raise OutOfBlocks(n, free, self.num_blocks)
        popped = self._free[free - n :][::-1]
        del self._free[free - n :]
        for b in popped:
            self._refs[b] = 1
            self._ever_allocated[b] = 1
        try:
            yield popped, free
        except ValueError:
            for b in popped:
                self._refs[b] = 0
            self._free.extend(reversed(popped))
            raise
        self._debug_check(op)

    def _debug_check(self, op: str, always: bool = False) -> None:
        if always or debug_enabled():
            top = int(self.top_counter.item())
            if top != len(self._free):
                raise RuntimeError(f"allocator {op}: device top {top} != host free count {len(self._free)}")

    def _release(self, block_ids: BlockIds, op: str) -> None:
        ids = self._host_ids(block_ids, op)
        for b in ids:
            if self._refs[b] == 0:
                what = "double free" if self._ever_allocated[b] else "never allocated"
                raise ValueError(f"{op}: block {b} is not allocated ({what})")
        top = len(self._free)
        for b in ids:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
        if ids:
            block_alloc.push_blocks(self, top, self._device_ids(ids))
        self._debug_check(op)

    def _host_ids(self, block_ids: BlockIds, op: str) -> list[int]:
        if isinstance(block_ids, torch.Tensor):
            if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
                raise ValueError(
                    f"{op}: block ids must be a 1-D integer tensor, got {tuple(block_ids.shape)} {block_ids.dtype}"
                )
            ids = block_ids.tolist()
        else:
            ids = list(block_ids)
            for b in ids:
                if isinstance(b, bool) or not isinstance(b, int):
                    raise ValueError(f"{op}: block ids must be ints, got {b!r}")
        for b in ids:
            self._check_range(b)
        if len(set(ids)) != len(ids):
            dup = next(b for i, b in enumerate(ids) if b in ids[:i])
            raise ValueError(f"{op}: block {dup} appears more than once in one call")
        return ids

    def _check_range(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")

    def _device_ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int32).to(self.device, non_blocking=True)  # (k,)
