"""The block allocator: a free stack and reference counts on the device, mirrored exactly on the host.

Two copies of one state machine, kept in lock-step:

- **Device state** (on the pool's device): `stack` (NB,) int32 of free ids with `top` entries
  live, `refcount` (NB,) int32, and a (1,) int32 counter of free blocks that the kernels keep on
  their own (each launch adds or subtracts what it pushed or popped). The per-step work
  (popping blocks into block tables, writing slot mappings) reads and writes this state on the
  device, so a decode step never waits for the host (see `helexa.kernels.block_alloc`).
- **Host mirror** (plain Python): the same stack as a list and the same reference counts. Every
  operation's outcome is decided by the host alone — how many blocks it takes, which ids it pops,
  which blocks reach zero — because the operations are deterministic. So `num_free_blocks` is
  exact without reading the device, and every request is **validated on the mirror before any
  state changes**: an out-of-range id, a double free, a free of a never-allocated block or an
  allocation beyond the free count raises and leaves both copies untouched. This costs O(ids)
  Python work per call (what a pure-Python block manager does anyway) and no synchronisation.
  Validating on the device instead would mean either a sync per call to raise, or errors
  deferred to a later sync with the pool frozen in between; the mirror raises at once, for free.

Debug mode (`HELEXA_DEBUG=1`, on in tests) reads the device counter after every operation and
raises if it differs from the mirror; `check_integrity()` compares the whole state.

Block 0 is **not** reserved: every one of the `num_blocks` blocks can be allocated. Padding
entries of a block table are 0 and never read (kernels stop at `seq_lens`), and a token that must
not be written gets slot `-1`, so no null block is needed.

Not thread-safe: one thread (the engine's) owns an allocator.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch

from helexa.kernels import block_alloc

__all__ = ["OutOfBlocks", "BlockAllocator", "AllocatorBackend", "BlockIds"]

AllocatorBackend = Literal["auto", "triton", "torch"]
BlockIds = Iterable[int] | torch.Tensor


class OutOfBlocks(RuntimeError):
    """An allocation asked for more blocks than are free. Nothing was allocated.

    Attributes: `requested`, `free` and `total` block counts at the time of the request.
    """

    def __init__(self, requested: int, free: int, total: int) -> None:
        super().__init__(f"out of KV blocks: requested {requested}, free {free}, total {total}")
        self.requested = requested
        self.free = free
        self.total = total

    def __reduce__(self) -> tuple:  # keep the numbers across pickling (multiprocessing, logging handlers)
        return (OutOfBlocks, (self.requested, self.free, self.total))


def _debug_enabled() -> bool:
    return os.environ.get("HELEXA_DEBUG", "0") not in ("", "0")


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if block_alloc._TRITON_MISSING:
            raise ValueError(block_alloc._TRITON_MISSING)
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise ValueError(
                f"allocator backend 'triton' on {device.type} needs TRITON_INTERPRET=1 (set before triton "
                "is imported); use backend 'torch' or 'auto' instead"
            )
        return "triton"
    raise ValueError(f"allocator backend must be 'auto', 'triton' or 'torch', got {backend!r}")


class BlockAllocator:
    """Allocates block ids in `[0, num_blocks)` with reference counts; see the module docstring.

    Guarantees (checked by `check_integrity`): every block is either on the free stack with
    refcount 0 or allocated with refcount >= 1, never both, never twice on the stack;
    `num_free_blocks + num_allocated_blocks == num_blocks`; the device state equals the mirror.
    Allocation order is deterministic: a fresh allocator hands out 0, 1, 2, ...; freed blocks go
    back on top of the stack and are handed out again first (last freed, first reused).
    """

    def __init__(self, num_blocks: int, device: torch.device | str, backend: AllocatorBackend = "auto") -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if num_blocks >= 2**31:
            raise ValueError(f"num_blocks must be < 2**31 (block ids are int32), got {num_blocks}")
        self.device = torch.device(device)
        if self.device.type == "meta":
            raise ValueError("the allocator needs a real device; put only the K/V tensors on 'meta'")
        self.backend = _resolve_backend(backend, self.device)
        self._ops = _OPS[self.backend]
        self._num_blocks = num_blocks

        # Host mirror. `_free[-1]` is popped first; `_refs[i]` counts references to block i.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs: list[int] = [0] * num_blocks
        self._ever_allocated = bytearray(num_blocks)  # for "double free" vs "never allocated"

        # Device state, identical to the mirror.
        self.stack = torch.arange(num_blocks - 1, -1, -1, dtype=torch.int32, device=self.device)  # (NB,)
        self.refcount = torch.zeros(num_blocks, dtype=torch.int32, device=self.device)  # (NB,)
        self.top_counter = torch.full((1,), num_blocks, dtype=torch.int32, device=self.device)  # (1,)

    # ---------------------------------------------------------------- counts (host, exact, no sync)

    @property
    def num_blocks(self) -> int:
        """Total blocks managed (all allocatable)."""
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free stack now: exact, read from the host mirror (no device sync)."""
        return len(self._free)

    @property
    def num_allocated_blocks(self) -> int:
        """Blocks with at least one reference: `num_blocks - num_free_blocks`."""
        return self._num_blocks - len(self._free)

    def refcount_of(self, block_id: int) -> int:
        """The reference count of one block, from the host mirror (0 = free)."""
        self._check_range(block_id)
        return self._refs[block_id]

    def can_allocate(self, n: int) -> bool:
        """True when `allocate(n)` would succeed now (the check half of check/commit)."""
        return _count(n, "n") <= len(self._free)

    # ---------------------------------------------------------------- operations

    def allocate(self, n: int) -> torch.Tensor:
        """Take `n` free blocks; returns their ids as an (n,) int32 tensor on the device.

        Each gets reference count 1. Raises `OutOfBlocks` (nothing taken) when `n` exceeds the
        free count, `ValueError` for a negative or non-int `n`. No synchronisation.
        """
        popped = self._pop_host(n)
        try:
            out = self._ops.pop(self.stack, self.refcount, self.top_counter, len(self._free) + n, n)
        except ValueError:
            self._unpop_host(popped)
            raise
        self._debug_check("allocate")
        return out

    def free(self, block_ids: BlockIds) -> None:
        """Release one reference to each block; a block whose count reaches zero becomes free.

        For a block allocated once and never shared this frees it. Ids must be distinct within one
        call. Raises `ValueError`, changing nothing, for an id out of range, a block that is free
        (double free) or was never allocated, or a repeated id. Pass host ids (a list, or a CPU
        tensor) to avoid a device sync; a device tensor is read on the host to validate it.
        """
        self._release(block_ids, "free")

    def decref(self, block_ids: BlockIds) -> None:
        """Drop one reference to each block (the same operation as `free`, named for sharing).

        Blocks reaching zero return to the free stack in the order given. Errors as for `free`.
        """
        self._release(block_ids, "decref")

    def incref(self, block_ids: BlockIds) -> None:
        """Add one reference to each allocated block (to share it, e.g. from the prefix cache).

        Raises `ValueError`, changing nothing, for an id out of range, a free block or a repeated id.
        """
        ids = self._host_ids(block_ids, "incref")
        for b in ids:
            if self._refs[b] == 0:
                raise ValueError(f"incref: block {b} is free; only allocated blocks can be shared")
        for b in ids:
            self._refs[b] += 1
        if ids:
            self._ops.incref(self.refcount, self._device_ids(ids))
        self._debug_check("incref")

    # ---------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Raise `RuntimeError` unless every invariant holds, on the mirror and on the device.

        Every block is exactly once in {free stack, allocated}; free blocks have refcount 0 and
        allocated ones >= 1; the device stack, top and reference counts equal the mirror.
        Synchronises with the device (it reads the whole state).
        """
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise RuntimeError("allocator: a block is on the free stack twice")
        allocated = [b for b, r in enumerate(self._refs) if r > 0]
        if any(r < 0 for r in self._refs):
            raise RuntimeError("allocator: negative reference count")
        if free_set.intersection(allocated):
            raise RuntimeError(f"allocator: blocks both free and allocated: {sorted(free_set.intersection(allocated))[:8]}")
        if len(free_set) + len(allocated) != self._num_blocks:
            raise RuntimeError(
                f"allocator: free {len(free_set)} + allocated {len(allocated)} != total {self._num_blocks}"
            )
        top = int(self.top_counter.item())
        if top != len(self._free):
            raise RuntimeError(f"allocator: device top {top} != host free count {len(self._free)}")
        if self.stack[:top].tolist() != self._free:
            raise RuntimeError("allocator: device free stack differs from the host mirror")
        if self.refcount.tolist() != self._refs:
            raise RuntimeError("allocator: device reference counts differ from the host mirror")

    # ---------------------------------------------------------------- for BatchBuilder

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
        """Pop `total_new` blocks into block-table rows and emit a step's tables and slots.

        The device half is `helexa.kernels.block_alloc.extend_tables_*` (see there for the
        argument shapes). Returns the popped ids in pop order (host list, the mirror's answer),
        `block_tables` (B, width) int32 and `slot_mapping` (num_tokens,) int64 on the device.
        Raises `OutOfBlocks` before any change when `total_new` exceeds the free count.
        """
        popped = self._pop_host(total_new)
        top = len(self._free) + total_new
        try:
            out_tables, slots = self._ops.extend(
                self.stack, self.refcount, self.top_counter, top, tables, rows, seq_lens, query_start_loc,
                alloc_start, total_new, width, num_tokens, block_size,
            )
        except ValueError:  # argument checks run before the device state is touched: undo the mirror
            self._unpop_host(popped)
            raise
        self._debug_check("extend")
        return popped, out_tables, slots

    def _pop_host(self, n: int) -> list[int]:
        """Validate and pop `n` ids on the mirror (first popped first); the caller launches the device op."""
        n = _count(n, "n")
        free = len(self._free)
        if n > free:
            raise OutOfBlocks(n, free, self._num_blocks)
        popped = self._free[free - n :][::-1]
        del self._free[free - n :]
        for b in popped:
            self._refs[b] = 1
            self._ever_allocated[b] = 1
        return popped

    def _unpop_host(self, popped: list[int]) -> None:
        for b in popped:
            self._refs[b] = 0
        self._free.extend(reversed(popped))

    def _debug_check(self, op: str) -> None:
        if _debug_enabled():
            top = int(self.top_counter.item())
            if top != len(self._free):
                raise RuntimeError(f"allocator {op}: device top {top} != host free count {len(self._free)}")

    # ---------------------------------------------------------------- private

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
            self._ops.push(self.stack, self.refcount, self.top_counter, top, self._device_ids(ids))
        self._debug_check(op)

    def _host_ids(self, block_ids: BlockIds, op: str) -> list[int]:
        if isinstance(block_ids, torch.Tensor):
            if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
                raise ValueError(f"{op}: block ids must be a 1-D integer tensor, got {tuple(block_ids.shape)} {block_ids.dtype}")
            ids = block_ids.tolist()
        else:
            ids = list(block_ids)
            for b in ids:
                if isinstance(b, bool) or not isinstance(b, int):
                    raise ValueError(f"{op}: block ids must be ints, got {b!r}")
        for b in ids:
            self._check_range(b)
        if len(set(ids)) != len(ids):
            seen: set[int] = set()
            dup = next(b for b in ids if b in seen or seen.add(b))
            raise ValueError(f"{op}: block {dup} appears more than once in one call")
        return ids

    def _check_range(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self._num_blocks})")

    def _device_ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int32).to(self.device, non_blocking=True)  # (k,)


def _count(n: int, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    return n


@dataclass(frozen=True)
class _Ops:
    """The device operations of one backend (signatures in `helexa.kernels.block_alloc`)."""

    pop: Callable[..., torch.Tensor]
    push: Callable[..., None]
    incref: Callable[..., None]
    extend: Callable[..., tuple[torch.Tensor, torch.Tensor]]


_OPS = {
    "triton": _Ops(
        block_alloc.pop_blocks_triton,
        block_alloc.push_blocks_triton,
        block_alloc.incref_blocks_triton,
        block_alloc.extend_tables_triton,
    ),
    "torch": _Ops(
        block_alloc.pop_blocks_torch,
        block_alloc.push_blocks_torch,
        block_alloc.incref_blocks_torch,
        block_alloc.extend_tables_torch,
    ),
}
