"""The block allocator's Triton kernels and their launchers (`helexa.kernels.block_alloc` owns the
checks, the torch ops and the choice between the two, and imports this module only when a state runs
Triton: CUDA, or CPU under `TRITON_INTERPRET=1`). Arguments arrive checked; no launcher synchronises.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["extend", "incref", "pop", "push"]

_BLOCK = 1024  # ids per program (pop, incref) or per loop iteration (push)
_BLOCK_N, _BLOCK_W, _BLOCK_T = 16, 64, 256  # extend: new blocks, table columns, tokens per loop iteration

# The arguments of one table extend after the state: block_alloc.ExtendStep's fields, in its order.
Step = tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]


@triton.jit(do_not_specialize=["top", "n"])
def _pop_kernel(stack_ptr, refcount_ptr, top_ptr, out_ptr, top, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = i < n
    block_id = tl.load(stack_ptr + (top - 1 - i), mask=mask, other=0)
    tl.store(out_ptr + i, block_id, mask=mask)
    tl.store(refcount_ptr + block_id, tl.full([BLOCK], 1, tl.int32), mask=mask)
    if pid == 0:
        tl.store(top_ptr, tl.load(top_ptr) - n)


@triton.jit(do_not_specialize=["top"])
def _push_kernel(stack_ptr, refcount_ptr, top_ptr, ids_ptr, top, n, BLOCK: tl.constexpr):
    # One program walks the ids in order, so the pushed order is the order of `ids`.
    pushed = 0
    i0 = 0
    while i0 < n:
        i = i0 + tl.arange(0, BLOCK)  # (BLOCK,)
        mask = i < n
        block_id = tl.load(ids_ptr + i, mask=mask, other=0)
        count = tl.load(refcount_ptr + block_id, mask=mask, other=1) - 1
        tl.store(refcount_ptr + block_id, count, mask=mask)
        freed = ((count == 0) & mask).to(tl.int32)  # (BLOCK,)
        pos = top + pushed + tl.cumsum(freed, axis=0) - freed
        tl.store(stack_ptr + pos, block_id, mask=freed != 0)
        pushed += tl.sum(freed, axis=0)
        i0 += BLOCK
    tl.store(top_ptr, tl.load(top_ptr) + pushed)


@triton.jit
def _incref_kernel(refcount_ptr, ids_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    block_id = tl.load(ids_ptr + i, mask=mask, other=0)
    tl.atomic_add(refcount_ptr + block_id, tl.full([BLOCK], 1, tl.int32), mask=mask)


@triton.jit
def _block_at(row_ptr, stack_ptr, first, old_blocks, col, valid):
    """Block id at table column `col` where `valid`, else 0: from the table row below `old_blocks`,
    else from the stack (never reading back what `_extend_kernel` just wrote to the row)."""
    is_old = valid & (col < old_blocks)
    old_id = tl.load(row_ptr + col, mask=is_old, other=0)
    new_id = tl.load(stack_ptr + (first - (col - old_blocks)), mask=valid & (col >= old_blocks), other=0)
    return tl.where(is_old, old_id, new_id)


@triton.jit(do_not_specialize=["top", "total_new"])
def _extend_kernel(
    stack_ptr, refcount_ptr, top_ptr,
    tables_ptr, table_stride,  # (R, MB)
    rows_ptr, seq_lens_ptr, qsl_ptr, alloc_start_ptr,  # (B,), (B,), (B+1,), (B,)
    out_tables_ptr,  # (B, width)
    out_slots_ptr,  # (T,) int64
    top, total_new, width, block_size,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    old_len = seq_len - q_len
    old_blocks = (old_len + block_size - 1) // block_size
    new_blocks = (seq_len + block_size - 1) // block_size
    row_ptr = tables_ptr + row * table_stride
    first = top - 1 - tl.load(alloc_start_ptr + b)  # stack index of this sequence's first new block

    # 1. Pop this sequence's new blocks into its table row, each with one reference.
    j0 = 0
    while j0 < new_blocks - old_blocks:
        j = j0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        mask = j < new_blocks - old_blocks
        block_id = tl.load(stack_ptr + (first - j), mask=mask, other=0)
        tl.store(row_ptr + old_blocks + j, block_id, mask=mask)
        tl.store(refcount_ptr + block_id, tl.full([BLOCK_N], 1, tl.int32), mask=mask)
        j0 += BLOCK_N

    # 2. The batch's table row, zero after the sequence's blocks.
    c0 = 0
    while c0 < width:
        c = c0 + tl.arange(0, BLOCK_W)  # (BLOCK_W,)
        block_id = _block_at(row_ptr, stack_ptr, first, old_blocks, c, c < new_blocks)
        tl.store(out_tables_ptr + b * width + c, block_id, mask=c < width)
        c0 += BLOCK_W

    # 3. Slot of each new token: block id * block_size + offset, in 64 bits.
    t0 = 0
    while t0 < q_len:
        t = t0 + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
        mask = t < q_len
        pos = old_len + t
        block_id = _block_at(row_ptr, stack_ptr, first, old_blocks, pos // block_size, mask).to(tl.int64)
        tl.store(out_slots_ptr + q_start + t, block_id * block_size + pos % block_size, mask=mask)
        t0 += BLOCK_T

    if b == 0:
        tl.store(top_ptr, tl.load(top_ptr) - total_new)


def pop(stack: torch.Tensor, refcount: torch.Tensor, top_counter: torch.Tensor, top: int, n: int) -> torch.Tensor:
    """(n,) int32 ids stack[top-1], ..., stack[top-n], each given refcount 1; top_counter -= n."""
    out = torch.empty(n, dtype=torch.int32, device=stack.device)  # (n,)
    grid = (max(1, triton.cdiv(n, _BLOCK)),)
    _pop_kernel[grid](stack, refcount, top_counter, out, top, n, BLOCK=_BLOCK)
    return out


def push(stack: torch.Tensor, refcount: torch.Tensor, top_counter: torch.Tensor, top: int, ids: torch.Tensor) -> None:
    """One reference less for each of `ids`; those at zero pushed in the order of `ids` (one program)."""
    _push_kernel[(1,)](stack, refcount, top_counter, ids, top, ids.shape[0], BLOCK=_BLOCK)


def incref(refcount: torch.Tensor, ids: torch.Tensor) -> None:
    """One reference more for each of `ids` (non-empty)."""
    _incref_kernel[(triton.cdiv(ids.shape[0], _BLOCK),)](refcount, ids, ids.shape[0], BLOCK=_BLOCK)


def extend(
    stack: torch.Tensor, refcount: torch.Tensor, top_counter: torch.Tensor, step: Step
) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_alloc.extend_tables` in one launch of B programs: (block_tables (B, width) int32, slots (T,) int64)."""
    top, total_new, tables, rows, seq_lens, query_start_loc, alloc_start, width, num_tokens, block_size = step
    batch = rows.shape[0]
    out_tables = torch.empty(batch, width, dtype=torch.int32, device=stack.device)  # (B, width)
    out_slots = torch.empty(num_tokens, dtype=torch.int64, device=stack.device)  # (T,)
    if batch:
        _extend_kernel[(batch,)](
            stack, refcount, top_counter, tables, tables.stride(0), rows, seq_lens, query_start_loc, alloc_start,
            out_tables, out_slots, top, total_new, width, block_size,
            BLOCK_N=_BLOCK_N, BLOCK_W=_BLOCK_W, BLOCK_T=_BLOCK_T,
        )  # fmt: skip
    return out_tables, out_slots
