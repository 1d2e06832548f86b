"""The block allocator's device operations: pop, push, incref and the per-step table extend.

Each operation runs as a Triton kernel (`state.use_triton`: CUDA, or CPU under `TRITON_INTERPRET=1`)
or as torch ops (the per-step table extend on a CPU: NumPy views of the same tensors, a tenth of the
per-call cost); all leave identical state. The caller passes the free count `top` from its exact
host mirror, so programs never race on a counter; each launch moves `top_counter` by what it pushed
or popped, so debug mode can compare the two. None of these functions validates block ids (the
caller does, on its mirror, before any change) or reads a device value on the host unless its
docstring says so. Loops are `while` loops: the Triton 3.6 interpreter (NumPy >= 2.4) cannot use
its scalars as `range()` bounds.
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType
from typing import NamedTuple, Protocol

import numpy as np
import torch

TRITON_MISSING = (
    ""
    if importlib.util.find_spec("triton") is not None
    else "the Triton allocator kernels need the `triton` package; use backend 'torch'"
)


__all__ = ["TRITON_MISSING", "AllocatorState", "extend_tables", "incref_blocks", "pop_blocks", "push_blocks"]


@functools.cache
def _kernels() -> ModuleType:
    """The Triton kernels (`block_alloc_triton`), imported on first use: a CPU engine runs the torch ops
    and never loads Triton (tens of MiB resident)."""
    from helexa.kernels import block_alloc_triton

    return block_alloc_triton


class AllocatorState(Protocol):
    """The device state of a block allocator (`helexa.kvcache.BlockAllocator`)."""

    stack: torch.Tensor  # (NB,) int32 free block ids: [0, top) are free, stack[top-1] is popped first
    refcount: torch.Tensor  # (NB,) int32 references per block, 0 exactly when on the free stack
    top_counter: torch.Tensor  # (1,) int32 the device copy of the free count
    use_triton: bool  # Triton kernels, else torch ops


def _check_vector(name: str, t: torch.Tensor, device: torch.device, length: int | None = None) -> None:
    if t.dim() != 1 or t.dtype != torch.int32 or not t.is_contiguous() or length not in (None, t.shape[0]):
        want = "1-D" if length is None else f"({length},)"
        raise ValueError(f"{name} must be a contiguous {want} int32 tensor, got {tuple(t.shape)} {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the allocator is on {device}")


def _check_state(state: AllocatorState, top: int, popped: int = 0) -> None:
    """The state tensors have the documented layout and `0 <= popped <= top <= NB`."""
    stack = state.stack
    _check_vector("stack", stack, stack.device)
    _check_vector("refcount", state.refcount, stack.device, stack.shape[0])
    _check_vector("top_counter", state.top_counter, stack.device, 1)
    if not 0 <= popped <= top <= stack.shape[0]:
        raise ValueError(f"cannot pop {popped} blocks with top={top} of {stack.shape[0]}")


def pop_blocks(state: AllocatorState, top: int, n: int) -> torch.Tensor:
    """Pop `n` blocks (0 <= n <= top): returns (n,) int32 ids `stack[top-1], ..., stack[top-n]`, sets
    their reference counts to 1 and subtracts n from `top_counter`. One launch, no synchronisation."""
    _check_state(state, top, n)
    if not state.use_triton:
        out = state.stack[top - n : top].flip(0).clone()  # (n,), first popped first
        state.refcount[out.long()] = 1
        state.top_counter.sub_(n)
        return out
    return _kernels().pop(state.stack, state.refcount, state.top_counter, top, n)


def push_blocks(state: AllocatorState, top: int, ids: torch.Tensor) -> None:
    """Drop one reference from each of `ids` ((k,) int32, distinct, all allocated). Blocks reaching
    zero are pushed on the free stack in the order of `ids`, and `top_counter` grows by their number.
    Triton: one single-program launch, no sync; torch: reads the freed count on the host."""
    _check_state(state, top)
    _check_vector("block ids", ids, state.stack.device)
    if state.use_triton:
        _kernels().push(state.stack, state.refcount, state.top_counter, top, ids)
        return
    idx = ids.long()  # (k,)
    counts = state.refcount[idx] - 1  # (k,)
    state.refcount[idx] = counts
    freed = ids[counts == 0]  # (f,) in the order of `ids`
    state.stack[top : top + freed.shape[0]] = freed
    state.top_counter.add_(freed.shape[0])


def incref_blocks(state: AllocatorState, ids: torch.Tensor) -> None:
    """Add one reference to each of `ids` ((k,) int32, allocated). One launch, no sync."""
    _check_vector("block ids", ids, state.refcount.device)
    if not state.use_triton:
        state.refcount.index_add_(0, ids.long(), torch.ones_like(ids))
    elif ids.shape[0]:
        _kernels().incref(state.refcount, ids)


class ExtendStep(NamedTuple):
    """The arguments of one `extend_tables` call after the state (see there)."""

    top: int
    total_new: int
    tables: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    alloc_start: torch.Tensor
    width: int
    num_tokens: int
    block_size: int


def _segment_ids(starts: torch.Tensor, total: int) -> torch.Tensor:
    """(total,) int64: for each item k the largest b with starts[b] <= k (starts: (B,), non-decreasing, from 0)."""
    marks = torch.zeros(total + 1, dtype=torch.int64, device=starts.device)  # (total+1,)
    marks.index_add_(0, starts[1:].clamp(max=total), torch.ones_like(starts[1:]))
    return marks[:total].cumsum(0)


def extend_tables(
    state: AllocatorState,
    top: int,
    total_new: int,
    tables: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    alloc_start: torch.Tensor,
    width: int,
    num_tokens: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Extend the batch's block tables by the blocks their new tokens need; emit tables and slots.

    tables: (R, MB) int32 with unit column stride, row `rows[b]` holding sequence b's block ids;
    rows, seq_lens, alloc_start: (B,) int32; query_start_loc: (B+1,) int32. Sequence b grows from
    `seq_lens[b] - q_len_b` to `seq_lens[b]` tokens and pops the blocks that needs from the stack in
    batch order, starting `alloc_start[b]` pops below `top` (`total_new <= top` pops in all); new
    blocks get refcount 1. Returns `block_tables` (B, width) int32, zero-padded, and `slot_mapping`
    (num_tokens,) int64. Triton: one launch of B programs; no synchronisation either way.
    """
    _check_state(state, top, total_new)
    stack, refcount, top_counter = state.stack, state.refcount, state.top_counter
    device, batch = stack.device, rows.shape[0]
    if tables.dim() != 2 or tables.dtype != torch.int32 or tables.stride(1) != 1 or tables.device != device:
        raise ValueError(f"tables must be (rows, max_blocks) int32 with unit column stride on {device}, got "
                         f"{tuple(tables.shape)} {tables.dtype} on {tables.device}")  # fmt: skip
    for name, t in (("rows", rows), ("seq_lens", seq_lens), ("alloc_start", alloc_start)):
        _check_vector(name, t, device, batch)
    _check_vector("query_start_loc", query_start_loc, device, batch + 1)
    if not 1 <= width <= tables.shape[1]:
        raise ValueError(f"width {width} must be in [1, {tables.shape[1]}]")
    step = ExtendStep(
        top, total_new, tables, rows, seq_lens, query_start_loc, alloc_start, width, num_tokens, block_size
    )
    if state.use_triton:
        return _kernels().extend(stack, refcount, top_counter, step)
    if device.type == "cpu":
        return _extend_numpy(state, step)
    return _extend_torch(state, step)


def _extend_torch(state: AllocatorState, step: ExtendStep) -> tuple[torch.Tensor, torch.Tensor]:
    """`extend_tables` as torch ops (any device), on checked arguments."""
    top, total_new, tables, rows, seq_lens, query_start_loc, alloc_start, width, num_tokens, block_size = step
    stack, refcount, top_counter = state.stack, state.refcount, state.top_counter
    device = stack.device
    # Small index ops only (no repeat_interleave or large index_select): a step is a few hundred
    # elements, so staying single-threaded matters more than vector width.
    qsl = query_start_loc.long()  # (B+1,)
    lens = seq_lens.long()  # (B,)
    old_lens = lens - (qsl[1:] - qsl[:-1])  # (B,)
    old_blocks = (old_lens + block_size - 1) // block_size  # (B,)
    new_blocks = (lens + block_size - 1) // block_size  # (B,)
    rows64, start64 = rows.long(), alloc_start.long()  # (B,)
    # 1. Pop total_new blocks in batch order into the rows.
    popped = stack[top - total_new : top].flip(0)  # (N,), popped[k] = stack[top-1-k]
    owner = _segment_ids(start64, total_new)  # (N,) sequence of each popped block
    tables[rows64[owner], old_blocks[owner] + torch.arange(total_new, device=device) - start64[owner]] = popped
    refcount[popped.long()] = 1
    top_counter.sub_(total_new)
    # 2. The batch's table rows, zero beyond each sequence's blocks.
    out_tables = tables[:, :width].index_select(0, rows64)  # (B, width)
    cols = torch.arange(width, device=device)  # (width,)
    out_tables = torch.where(cols[None, :] < new_blocks[:, None], out_tables, 0).to(torch.int32).contiguous()
    # 3. Slots of the new tokens.
    tok_seq = _segment_ids(qsl[:-1], num_tokens)  # (T,)
    pos = old_lens[tok_seq] + torch.arange(num_tokens, device=device) - qsl[tok_seq]  # (T,)
    block_ids = tables[rows64[tok_seq], pos // block_size].long()  # (T,)
    return out_tables, block_ids * block_size + pos % block_size


def _extend_numpy(state: AllocatorState, step: ExtendStep) -> tuple[torch.Tensor, torch.Tensor]:
    """`_extend_torch` on CPU tensors through NumPy views of the same memory: the same state changes
    and outputs, for a per-call cost a tenth of torch's on the few hundred values of a step (this
    runs once per engine step)."""
    top, total_new, tables, rows, seq_lens, query_start_loc, alloc_start, width, num_tokens, block_size = step
    stack, refcount, table = state.stack.numpy(), state.refcount.numpy(), tables.numpy()
    qsl = query_start_loc.numpy().astype(np.int64)  # (B+1,)
    lens = seq_lens.numpy().astype(np.int64)  # (B,)
    q_lens = qsl[1:] - qsl[:-1]  # (B,)
    old_lens = lens - q_lens
    old_blocks = (old_lens + block_size - 1) // block_size  # (B,)
    new_blocks = (lens + block_size - 1) // block_size  # (B,)
    rows64, start64 = rows.numpy().astype(np.int64), alloc_start.numpy().astype(np.int64)  # (B,)
    # 1. Pop total_new blocks in batch order into the rows (owner: the last b with start[b] <= k).
    if total_new:
        popped = stack[top - total_new : top][::-1]  # (N,), popped[k] = stack[top-1-k]
        owner = np.searchsorted(start64, np.arange(total_new), side="right") - 1  # (N,)
        table[rows64[owner], old_blocks[owner] + np.arange(total_new) - start64[owner]] = popped
        refcount[popped] = 1
    state.top_counter.numpy()[0] -= total_new
    # 2. The batch's table rows, zero beyond each sequence's blocks.
    visible = np.arange(width)[None, :] < new_blocks[:, None]  # (B, width)
    out_tables = np.where(visible, table[rows64, :width], 0).astype(np.int32)
    # 3. Slots of the new tokens.
    tok_seq = np.repeat(np.arange(rows64.shape[0]), q_lens)  # (T,)
    pos = old_lens[tok_seq] + np.arange(num_tokens) - qsl[tok_seq]  # (T,)
    block_ids = table[rows64[tok_seq], pos // block_size].astype(np.int64)  # (T,)
    return torch.from_numpy(out_tables), torch.from_numpy(block_ids * block_size + pos % block_size)
