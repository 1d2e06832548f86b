"""The block allocator's device operations: pop, push, incref and the per-step table extend.

The allocator keeps its state on the pool's device (see `helexa.kvcache.allocator`):

    stack     (NB,) int32  free block ids; entries [0, top) are free, stack[top-1] is popped first
    refcount  (NB,) int32  references per block; 0 exactly when the block is on the free stack
    top       (1,)  int32  the device copy of the free count

Every operation here exists twice with the same signature: `<op>_triton` (a Triton kernel, used on
CUDA and, under `TRITON_INTERPRET=1`, on CPU in tests) and `<op>_torch` (torch ops, used elsewhere).
They produce identical state. The host passes the current free count `top` as an argument (its
exact mirror, see `BlockAllocator`), so a launch of many programs never races on reading a counter
another program writes. The device counter is kept independently — one program per launch adds
or subtracts the number of blocks it pushed or popped — so debug mode can compare it with the
mirror and catch a divergence.

Loops are `while` loops: the Triton interpreter (NumPy >= 2.4) cannot use its 1-element scalars
as `range()` bounds, and these loops are short (decode: one iteration).

None of these functions validates block ids: the caller (`BlockAllocator`) validates on its host
mirror *before* calling, so an invalid request raises before any state changes. They never read a
device value on the host (no synchronisation) except where a docstring says so.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
    _TRITON_MISSING = ""
except ModuleNotFoundError as exc:  # triton is a Linux-only dependency; the torch versions still work
    if exc.name != "triton":
        raise
    _TRITON_MISSING = f"the Triton allocator kernels need the `triton` package ({exc}); use backend 'torch'"

    def _jit(fn: Callable | None = None, **_: object) -> Callable:
        return fn if fn is not None else (lambda f: f)


def _require_triton() -> None:
    if _TRITON_MISSING:
        raise RuntimeError(_TRITON_MISSING)

__all__ = [
    "pop_blocks_triton",
    "pop_blocks_torch",
    "push_blocks_triton",
    "push_blocks_torch",
    "incref_blocks_triton",
    "incref_blocks_torch",
    "extend_tables_triton",
    "extend_tables_torch",
    "gpu_check_cases",
]

_BLOCK = 1024  # ids handled per program (pop, incref) or per loop iteration (push)
_BLOCK_N = 16  # new blocks per loop iteration of one sequence in `extend` (decode needs <= 1)
_BLOCK_W = 64  # block-table columns per loop iteration in `extend`
_BLOCK_T = 256  # new tokens per loop iteration in `extend`


def _check_state(stack: torch.Tensor, refcount: torch.Tensor, top_counter: torch.Tensor) -> None:
    """Raise `ValueError` unless the allocator state tensors have the documented layout."""
    if stack.dim() != 1 or stack.dtype != torch.int32 or not stack.is_contiguous():
        raise ValueError(f"stack must be a contiguous (num_blocks,) int32 tensor, got {tuple(stack.shape)} {stack.dtype}")
    if refcount.shape != stack.shape or refcount.dtype != torch.int32 or not refcount.is_contiguous():
        raise ValueError(f"refcount must be a contiguous {tuple(stack.shape)} int32 tensor, got {tuple(refcount.shape)}")
    if top_counter.shape != (1,) or top_counter.dtype != torch.int32:
        raise ValueError(f"top_counter must be a (1,) int32 tensor, got {tuple(top_counter.shape)} {top_counter.dtype}")
    for name, t in (("refcount", refcount), ("top_counter", top_counter)):
        if t.device != stack.device:
            raise ValueError(f"{name} is on {t.device} but stack is on {stack.device}")


def _check_ids(ids: torch.Tensor, stack: torch.Tensor) -> None:
    if ids.dim() != 1 or ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError(f"block ids must be a contiguous 1-D int32 tensor, got {tuple(ids.shape)} {ids.dtype}")
    if ids.device != stack.device:
        raise ValueError(f"block ids are on {ids.device} but the allocator is on {stack.device}")


# --------------------------------------------------------------------------------------------
# pop: allocate n blocks


@_jit(do_not_specialize=["top", "n"])
def _pop_kernel(stack_ptr, refcount_ptr, top_ptr, out_ptr, top, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = i < n
    block_id = tl.load(stack_ptr + (top - 1 - i), mask=mask, other=0)
    tl.store(out_ptr + i, block_id, mask=mask)
    tl.store(refcount_ptr + block_id, tl.full([BLOCK], 1, tl.int32), mask=mask)
    if pid == 0:
        tl.store(top_ptr, tl.load(top_ptr) - n)


def pop_blocks_triton(
    stack: torch.Tensor, refcount: torch.Tensor, top_counter: torch.Tensor, top: int, n: int
) -> torch.Tensor:
    """Pop `n` blocks off the free stack: returns (n,) int32 ids `stack[top-1], ..., stack[top-n]`.

    Sets their reference counts to 1 and subtracts `n` from the device counter. Requires
    `0 <= n <= top` (the caller checks); one launch, no synchronisation.
    """
    _require_triton()
    _check_state(stack, refcount, top_counter)
    if not 0 <= n <= top <= stack.shape[0]:
        raise ValueError(f"cannot pop {n} blocks with top={top} of {stack.shape[0]}")
    out = torch.empty(n, dtype=torch.int32, device=stack.device)  # (n,)
    grid = (max(1, triton.cdiv(n, _BLOCK)),)
    _pop_kernel[grid](stack, refcount, top_counter, out, top, n, BLOCK=_BLOCK)
    return out


def pop_blocks_torch(
    stack: torch.Tensor, refcount: torch.Tensor, top_counter: torch.Tensor, top: int, n: int
) -> torch.Tensor:
    """Torch version of `pop_blocks_triton`, same arguments and result."""
    _check_state(stack, refcount, top_counter)
    if not 0 <= n <= top <= stack.shape[0]:
        raise ValueError(f"cannot pop {n} blocks with top={top} of {stack.shape[0]}")
    out = stack[top - n : top].flip(0).clone()  # (n,) — first popped first
    refcount[out.long()] = 1
    top_counter.sub_(n)
    return out


# --------------------------------------------------------------------------------------------
# push: drop one reference per block; blocks reaching zero go back on the stack


@_jit(do_not_specialize=["top"])
def _push_kernel(stack_ptr, refcount_ptr, top_ptr, ids_ptr, top, n, BLOCK: tl.constexpr):
    # One program walks the ids in order so the pushed order is deterministic (= order in `ids`).
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


def push_blocks_triton(
    stack: torch.Tensor, refcount: torch.Tensor, top_counter: torch.Tensor, top: int, ids: torch.Tensor
) -> None:
    """Decrement the reference count of each of `ids` ((k,) int32, distinct, all allocated).

    Blocks whose count reaches zero are pushed on the free stack in the order they appear in
    `ids`; the device counter grows by the number pushed. One single-program launch, no sync.
    """
    _require_triton()
    _check_state(stack, refcount, top_counter)
    _check_ids(ids, stack)
    _push_kernel[(1,)](stack, refcount, top_counter, ids, top, ids.shape[0], BLOCK=_BLOCK)


def push_blocks_torch(
    stack: torch.Tensor, refcount: torch.Tensor, top_counter: torch.Tensor, top: int, ids: torch.Tensor
) -> None:
    """Torch version of `push_blocks_triton`, same arguments and effect.

    Reads how many blocks were freed on the host (a synchronisation on an accelerator; this
    version serves CPU pools).
    """
    _check_state(stack, refcount, top_counter)
    _check_ids(ids, stack)
    idx = ids.long()  # (k,)
    counts = refcount[idx] - 1  # (k,)
    refcount[idx] = counts
    freed = ids[counts == 0]  # (f,) in the order of `ids`
    num_freed = int(freed.shape[0])
    stack[top : top + num_freed] = freed
    top_counter.add_(num_freed)


# --------------------------------------------------------------------------------------------
# incref: one more reference per block


@_jit
def _incref_kernel(refcount_ptr, ids_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    block_id = tl.load(ids_ptr + i, mask=mask, other=0)
    tl.atomic_add(refcount_ptr + block_id, tl.full([BLOCK], 1, tl.int32), mask=mask)


def incref_blocks_triton(refcount: torch.Tensor, ids: torch.Tensor) -> None:
    """Add one reference to each of `ids` ((k,) int32 on refcount's device). One launch, no sync."""
    _require_triton()
    _check_ids(ids, refcount)
    n = ids.shape[0]
    if n:
        _incref_kernel[(triton.cdiv(n, _BLOCK),)](refcount, ids, n, BLOCK=_BLOCK)


def incref_blocks_torch(refcount: torch.Tensor, ids: torch.Tensor) -> None:
    """Torch version of `incref_blocks_triton`."""
    _check_ids(ids, refcount)
    refcount.index_add_(0, ids.long(), torch.ones_like(ids))


# --------------------------------------------------------------------------------------------
# extend: grow block tables by the blocks a step's new tokens need, emit the batch's tables and slots


def _check_extend(
    stack: torch.Tensor,
    refcount: torch.Tensor,
    top_counter: torch.Tensor,
    tables: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    alloc_start: torch.Tensor,
    width: int,
) -> None:
    _check_state(stack, refcount, top_counter)
    if tables.dim() != 2 or tables.dtype != torch.int32 or tables.stride(1) != 1:
        raise ValueError(f"tables must be a (rows, max_blocks) int32 tensor with unit column stride, got {tuple(tables.shape)} {tables.dtype}")
    batch = rows.shape[0]
    for name, t, length in (
        ("rows", rows, batch),
        ("seq_lens", seq_lens, batch),
        ("query_start_loc", query_start_loc, batch + 1),
        ("alloc_start", alloc_start, batch),
    ):
        if t.dim() != 1 or t.shape[0] != length or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous ({length},) int32 tensor, got {tuple(t.shape)} {t.dtype}")
        if t.device != stack.device:
            raise ValueError(f"{name} is on {t.device} but the allocator is on {stack.device}")
    if tables.device != stack.device:
        raise ValueError(f"tables are on {tables.device} but the allocator is on {stack.device}")
    if not 1 <= width <= tables.shape[1]:
        raise ValueError(f"width {width} must be in [1, {tables.shape[1]}]")


@_jit(do_not_specialize=["top", "total_new"])
def _extend_kernel(
    stack_ptr, refcount_ptr, top_ptr,
    tables_ptr, table_stride,  # (R, MB)
    rows_ptr, seq_lens_ptr, qsl_ptr, alloc_start_ptr,  # (B,), (B,), (B+1,), (B,)
    out_tables_ptr,  # (B, width)
    out_slots_ptr,  # (T,) int64
    top, total_new, width, block_size,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    old_len = seq_len - q_len
    old_blocks = (old_len + block_size - 1) // block_size
    new_blocks = (seq_len + block_size - 1) // block_size
    row_ptr = tables_ptr + row * table_stride
    # Stack index of this sequence's first new block: the step pops in batch order.
    first = top - 1 - tl.load(alloc_start_ptr + b)

    # 1. Pop this sequence's new blocks into its table row; each starts with one reference.
    j0 = 0
    while j0 < new_blocks - old_blocks:
        j = j0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        mask = j < new_blocks - old_blocks
        block_id = tl.load(stack_ptr + (first - j), mask=mask, other=0)
        tl.store(row_ptr + old_blocks + j, block_id, mask=mask)
        tl.store(refcount_ptr + block_id, tl.full([BLOCK_N], 1, tl.int32), mask=mask)
        j0 += BLOCK_N

    # 2. The batch's table row: old blocks from the table, new ones straight from the stack (so no
    #    program reads back what another thread of it just wrote), zero padding after.
    c0 = 0
    while c0 < width:
        c = c0 + tl.arange(0, BLOCK_W)  # (BLOCK_W,)
        is_old = c < old_blocks
        is_new = (c >= old_blocks) & (c < new_blocks)
        old_id = tl.load(row_ptr + c, mask=is_old, other=0)
        new_id = tl.load(stack_ptr + (first - (c - old_blocks)), mask=is_new, other=0)
        tl.store(out_tables_ptr + b * width + c, tl.where(is_old, old_id, new_id), mask=c < width)
        c0 += BLOCK_W

    # 3. Slot of each new token: block id * block_size + offset, in 64 bits.
    t0 = 0
    while t0 < q_len:
        t = t0 + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
        mask = t < q_len
        pos = old_len + t
        col = pos // block_size
        is_old = mask & (col < old_blocks)
        is_new = mask & (col >= old_blocks)
        old_id = tl.load(row_ptr + col, mask=is_old, other=0)
        new_id = tl.load(stack_ptr + (first - (col - old_blocks)), mask=is_new, other=0)
        block_id = tl.where(is_old, old_id, new_id).to(tl.int64)
        tl.store(out_slots_ptr + q_start + t, block_id * block_size + pos % block_size, mask=mask)
        t0 += BLOCK_T

    if b == 0:
        tl.store(top_ptr, tl.load(top_ptr) - total_new)


def extend_tables_triton(
    stack: torch.Tensor,
    refcount: torch.Tensor,
    top_counter: torch.Tensor,
    top: int,
    tables: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    alloc_start: torch.Tensor,
    total_new: int,
    width: int,
    num_tokens: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Extend the batch's block tables by the blocks their new tokens need; emit tables and slots.

    tables: (R, MB) int32, row `rows[b]` holds sequence b's block ids; rows, seq_lens,
    alloc_start: (B,) int32; query_start_loc: (B+1,) int32. Sequence b had
    `seq_lens[b] - q_len_b` tokens and gains `q_len_b`; it needs
    `cdiv(seq_lens[b], block_size) - cdiv(old_len, block_size)` new blocks, popped from the
    stack in batch order starting `alloc_start[b]` pops below `top` (the caller's exclusive
    prefix sum; `total_new` pops in all, `total_new <= top`). New blocks get refcount 1.
    Returns `block_tables` (B, width) int32 (padding 0) and `slot_mapping` (num_tokens,) int64.
    One launch of B programs; no synchronisation.
    """
    _require_triton()
    _check_extend(stack, refcount, top_counter, tables, rows, seq_lens, query_start_loc, alloc_start, width)
    batch = rows.shape[0]
    out_tables = torch.empty(batch, width, dtype=torch.int32, device=stack.device)  # (B, width)
    out_slots = torch.empty(num_tokens, dtype=torch.int64, device=stack.device)  # (T,)
    if batch:
        _extend_kernel[(batch,)](
            stack, refcount, top_counter,
            tables, tables.stride(0),
            rows, seq_lens, query_start_loc, alloc_start,
            out_tables, out_slots,
            top, total_new, width, block_size,
            BLOCK_N=_BLOCK_N, BLOCK_W=_BLOCK_W, BLOCK_T=_BLOCK_T,
        )
    return out_tables, out_slots


def _segment_ids(starts: torch.Tensor, total: int) -> torch.Tensor:
    """For non-decreasing segment starts (B,) with starts[0] == 0, the segment of each of `total`
    items: the largest b with starts[b] <= k (empty segments are skipped). Returns (total,) int64."""
    marks = torch.zeros(total + 1, dtype=torch.int64, device=starts.device)  # (total+1,)
    marks.index_add_(0, starts[1:].clamp(max=total), torch.ones_like(starts[1:]))
    return marks[:total].cumsum(0)


def extend_tables_torch(
    stack: torch.Tensor,
    refcount: torch.Tensor,
    top_counter: torch.Tensor,
    top: int,
    tables: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    alloc_start: torch.Tensor,
    total_new: int,
    width: int,
    num_tokens: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `extend_tables_triton`, same arguments and results (no synchronisation)."""
    _check_extend(stack, refcount, top_counter, tables, rows, seq_lens, query_start_loc, alloc_start, width)
    device = stack.device
    batch = rows.shape[0]
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()  # (B,)
    lens = seq_lens.long()  # (B,)
    old_lens = lens - q_lens  # (B,)
    old_blocks = (old_lens + block_size - 1) // block_size  # (B,)
    new_blocks = (lens + block_size - 1) // block_size  # (B,)
    rows64 = rows.long()  # (B,)
    # Small index ops only (no repeat_interleave / large index_select): they stay single-threaded,
    # which matters more here than vector width — a step's tensors are a few hundred elements.

    # 1. Pop total_new blocks in batch order into the rows.
    popped = stack[top - total_new : top].flip(0)  # (N,) — popped[k] = stack[top-1-k]
    owner = _segment_ids(alloc_start.long(), total_new)  # (N,) sequence of each popped block
    col = old_blocks[owner] + torch.arange(total_new, device=device) - alloc_start.long()[owner]  # (N,)
    tables[rows64[owner], col] = popped
    refcount[popped.long()] = 1
    top_counter.sub_(total_new)

    # 2. The batch's table rows, zero beyond each sequence's blocks.
    out_tables = tables[:, :width].index_select(0, rows64)  # (B, width)
    cols = torch.arange(width, device=device)  # (width,)
    out_tables = torch.where(cols[None, :] < new_blocks[:, None], out_tables, 0).to(torch.int32).contiguous()

    # 3. Slots of the new tokens.
    tok_seq = _segment_ids(query_start_loc[:-1].long(), num_tokens)  # (T,)
    pos = old_lens[tok_seq] + torch.arange(num_tokens, device=device) - query_start_loc.long()[tok_seq]  # (T,)
    block_ids = tables[rows64[tok_seq], pos // block_size].long()  # (T,)
    slots = block_ids * block_size + pos % block_size  # (T,) int64
    return out_tables, slots


# --------------------------------------------------------------------------------------------
# timing hook for bench/gpu_check.py


def gpu_check_cases(device: str) -> list[tuple[str, Callable[[], None]]]:
    """Allocator launches on prepared inputs, each repeatable, for `bench/gpu_check.py` to time.

    On CUDA: a pool of 65536 blocks and 256 decoding sequences; on CPU (the interpreter dry run)
    the same with 16 sequences. Pop and extend take the host `top` as an argument, so running
    them again with the same `top` rewrites the same ids (only the scratch device counter moves);
    "pop+push" pops 256 blocks and pushes them back (same free set and refcounts; the pushed
    segment of the stack comes back in reverse order, which changes no timing).
    """
    _require_triton()
    dev = torch.device(device)
    batch = 256 if dev.type == "cuda" else 16
    num_blocks, block_size = 65536, 16
    stack = torch.arange(num_blocks - 1, -1, -1, dtype=torch.int32, device=dev)  # (NB,)
    refcount = torch.zeros(num_blocks, dtype=torch.int32, device=dev)  # (NB,)
    counter = torch.full((1,), num_blocks, dtype=torch.int32, device=dev)  # (1,)
    tables = torch.zeros(batch, 64, dtype=torch.int32, device=dev)  # (B, 64)
    rows = torch.arange(batch, dtype=torch.int32, device=dev)  # (B,)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)  # (B+1,) one token each
    # context 16 -> 17 crosses into a second block; 17 -> 18 stays in it
    grow = (torch.full((batch,), 17, dtype=torch.int32, device=dev), rows.clone(), batch)
    stay = (torch.full((batch,), 18, dtype=torch.int32, device=dev), torch.zeros_like(rows), 0)

    def pop() -> None:
        pop_blocks_triton(stack, refcount, counter, num_blocks, batch)

    def pop_push() -> None:
        ids = pop_blocks_triton(stack, refcount, counter, num_blocks, batch)
        push_blocks_triton(stack, refcount, counter, num_blocks - batch, ids)

    def extend(seq_lens: torch.Tensor, alloc_start: torch.Tensor, total_new: int) -> Callable[[], None]:
        def run() -> None:
            extend_tables_triton(
                stack, refcount, counter, num_blocks, tables, rows, seq_lens, qsl, alloc_start,
                total_new, 2, batch, block_size,
            )

        return run

    return [
        (f"pop_blocks {batch}", pop),
        (f"pop+push {batch} blocks", pop_push),
        (f"extend_tables {batch} seqs decode, 1 new block each", extend(*grow)),
        (f"extend_tables {batch} seqs decode, no new block", extend(*stay)),
    ]
