"""BlockTable / BatchBuilder: exact tables and slots, errors, and an end-to-end check through
`write_kv` and `paged_attention` (reference and Triton) against plain attention on the contiguous sequences."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from helexa.kernels import reference
from helexa.kvcache import AttentionMetadata, BatchBuilder, BlockPool, OutOfBlocks
from helexa.kvcache import batch as batch_module

BACKENDS = ["torch", "triton"]


def _builder(backend: str, num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 4, max_model_len: int = 32):
    pool = BlockPool(num_blocks, block_size, 1, 2, 8, torch.float32, "cpu", backend=backend)
    return pool, BatchBuilder(pool, max_num_seqs=max_num_seqs, max_model_len=max_model_len)


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_tables_and_slots(backend: str) -> None:
    pool, builder = _builder(backend)
    a, b = builder.new_table(), builder.new_table()
    attn = builder.build([(a, 6), (b, 1)])
    assert isinstance(attn, AttentionMetadata)
    assert a.block_ids == (0, 1) and b.block_ids == (2,)
    assert attn.block_tables.dtype == torch.int32 and attn.block_tables.tolist() == [[0, 1], [2, 0]]
    assert attn.slot_mapping.dtype == torch.int64 and attn.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5, 8]
    assert attn.seq_lens.dtype == torch.int32 and attn.seq_lens.tolist() == [6, 1]
    assert attn.query_start_loc.dtype == torch.int32 and attn.query_start_loc.tolist() == [0, 6, 7]
    assert (attn.max_query_len, attn.max_seq_len, attn.num_seqs, attn.num_tokens) == (6, 6, 2, 7)

    # b first this time: its new block is popped before a's; a's first two tokens fill block 1
    attn = builder.build([(b, 4), (a, 3)])
    assert b.block_ids == (2, 3) and a.block_ids == (0, 1, 4)
    assert attn.block_tables.tolist() == [[2, 3, 0], [0, 1, 4]]
    assert attn.slot_mapping.tolist() == [9, 10, 11, 12, 6, 7, 16]
    assert attn.seq_lens.tolist() == [5, 9] and attn.query_start_loc.tolist() == [0, 4, 7]
    assert (a.num_tokens, b.num_tokens, pool.num_free_blocks) == (9, 5, 11)
    builder.check_integrity()

    pool.decref(builder.release(a))  # 0, 1, 4 go back (pushed in that order)
    assert pool.num_free_blocks == 14 and a.released
    c = builder.new_table()
    attn = builder.build([(c, 9)])
    assert c.row == a.row and c.block_ids == (4, 1, 0)
    assert attn.slot_mapping.tolist() == [16, 17, 18, 19, 4, 5, 6, 7, 0]
    builder.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_steps_allocate_only_at_block_boundaries(backend: str) -> None:
    pool, builder = _builder(backend, block_size=4)
    t = builder.new_table()
    builder.build([(t, 3)])
    assert t.blocks_needed(1) == 0 and t.blocks_needed(2) == 1 and t.blocks_needed(6) == 2
    free = pool.num_free_blocks
    attn = builder.build([(t, 1)])  # position 3: still block 0
    assert pool.num_free_blocks == free and attn.slot_mapping.tolist() == [3]
    attn = builder.build([(t, 1)])  # position 4: a new block
    assert pool.num_free_blocks == free - 1 and t.block_ids == (0, 1) and attn.slot_mapping.tolist() == [4]
    builder.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gather_from", [512, 0], ids=["host lists", "gathered"])
def test_steps_that_need_no_block_skip_the_allocator(
    backend: str, seed: int, gather_from: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU pool a step whose tables need no new block (most decode steps) is built without the allocator
    (its slots from the tables' host block lists, its tables gathered from their rows); every step,
    allocating or not, gives exactly the tables
    (zero-padded), slots, lengths and offsets its tables' blocks define. Random mixes of decodes and
    longer chunks, with tables released and started again (their rows keep stale ids past their blocks)."""
    monkeypatch.setattr(batch_module, "GATHER_TABLES_FROM", gather_from)
    pool, builder = _builder(backend, num_blocks=64, block_size=4, max_num_seqs=4, max_model_len=48)
    calls = 0
    extend = pool.allocator.extend_tables

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return extend(*args, **kwargs)

    monkeypatch.setattr(pool.allocator, "extend_tables", counted)
    g = torch.Generator().manual_seed(seed)
    tables = [builder.new_table() for _ in range(4)]
    allocating_steps = free_steps = 0
    for step in range(40):
        if step % 10 == 9:  # end the longest sequence and start a new one in its row
            longest = max(tables, key=lambda t: t.num_tokens)
            pool.decref(builder.release(longest))
            tables[tables.index(longest)] = builder.new_table()
        picked = [t for t in tables if bool(torch.rand(1, generator=g) < 0.7)] or tables[:1]
        batch = [(t, 1 if bool(torch.rand(1, generator=g) < 0.8) else int(torch.randint(2, 7, (1,), generator=g)))
                 for t in picked]  # fmt: skip
        before, needed = [t.num_tokens for t, _ in batch], sum(t.blocks_needed(n) for t, n in batch)
        seen = calls
        attn = builder.build(batch)
        assert calls == seen + (needed > 0)
        allocating_steps, free_steps = allocating_steps + (needed > 0), free_steps + (needed == 0)
        ids = [list(t.block_ids) for t, _ in batch]
        width = max(map(len, ids))
        bs = pool.block_size
        assert attn.block_tables.dtype == torch.int32 and attn.slot_mapping.dtype == torch.int64
        assert attn.block_tables.tolist() == [row + [0] * (width - len(row)) for row in ids]
        assert attn.slot_mapping.tolist() == [
            row[p // bs] * bs + p % bs for (t, n), row, p0 in zip(batch, ids, before) for p in range(p0, p0 + n)
        ]
        assert attn.seq_lens.tolist() == [p0 + n for (_, n), p0 in zip(batch, before)]
        assert attn.query_start_loc.tolist() == [0, *itertools.accumulate(n for _, n in batch)]
        assert (attn.max_query_len, attn.max_seq_len) == (max(n for _, n in batch), max(attn.seq_lens.tolist()))
        builder.check_integrity()
    assert allocating_steps >= 5 and free_steps >= 5  # both paths ran


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_blocks_changes_nothing(backend: str) -> None:
    pool, builder = _builder(backend, num_blocks=4)
    a, b = builder.new_table(), builder.new_table()
    builder.build([(a, 8)])  # 2 blocks
    batch = [(a, 1), (b, 9)]  # 1 + 3 blocks, 2 free
    assert builder.blocks_needed(batch) == 4 > pool.num_free_blocks
    rows_before = builder.tables.clone()
    with pytest.raises(OutOfBlocks) as info:
        builder.build(batch)
    assert (info.value.requested, info.value.free, info.value.total) == (4, 2, 4)
    assert a.num_tokens == 8 and a.block_ids == (0, 1) and b.num_tokens == 0 and b.block_ids == ()
    assert torch.equal(builder.tables, rows_before) and pool.num_free_blocks == 2
    builder.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_table_starts_with_blocks_its_caller_holds(backend: str) -> None:
    pool, builder = _builder(backend)
    a = builder.new_table()
    builder.build([(a, 8)])  # blocks 0, 1 full
    b = builder.new_table(a.block_ids)  # b starts with a's two full blocks; the builder takes no reference
    assert b.num_tokens == 8 and pool.refcount(0) == 1 and pool.refcount(1) == 1
    attn = builder.build([(b, 2)])
    assert b.block_ids == (0, 1, 2) and attn.slot_mapping.tolist() == [8, 9]
    assert attn.block_tables.tolist() == [[0, 1, 2]]
    assert builder.release(a) == [0, 1]  # the ids come back; nothing is dropped by the builder
    assert pool.num_free_blocks == 13
    builder.check_integrity()
    assert builder.release(b) == [0, 1, 2]
    pool.decref([0, 1, 2])
    assert pool.num_free_blocks == 16
    builder.check_integrity()


def test_bad_batches_raise_and_change_nothing() -> None:
    pool, builder = _builder("torch", max_num_seqs=2, max_model_len=10)
    a, b = builder.new_table(), builder.new_table()
    with pytest.raises(ValueError, match="rows are in use"):
        builder.new_table()
    with pytest.raises(ValueError, match="at least one"):
        builder.build([])
    with pytest.raises(ValueError, match=">= 1"):
        builder.build([(a, 0)])
    with pytest.raises(ValueError, match="twice"):
        builder.build([(a, 1), (a, 1)])
    with pytest.raises(ValueError, match="max_model_len 10"):
        builder.build([(a, 2), (b, 11)])
    assert a.num_tokens == 0 and pool.num_free_blocks == 16
    other_pool, other = _builder("torch")
    with pytest.raises(ValueError, match="does not belong"):
        other.build([(a, 1)])
    assert builder.release(a) == []
    with pytest.raises(ValueError, match="released"):
        builder.release(a)
    with pytest.raises(ValueError, match="released"):
        builder.build([(a, 1)])
    with pytest.raises(ValueError, match="is free"):
        builder.new_table([3])
    assert builder.num_live_tables == 1
    builder.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_slots_beyond_32_bits(backend: str) -> None:
    """Slots of 2**31 and above are exact int64: 2**19 + 64 blocks of 4096 tokens (K/V on meta)."""
    block_size, first = 1 << 12, 1 << 19  # block `first` starts at slot 2**31
    pool = BlockPool(first + 64, block_size, 1, 1, 1, torch.float16, "cpu", backend=backend, kv_device="meta")
    builder = BatchBuilder(pool, max_num_seqs=2, max_model_len=3 * block_size)
    pool.allocate(first)  # the next blocks popped are first, first + 1, ...
    a, b = builder.new_table(), builder.new_table()
    attn = builder.build([(a, 3), (b, 2)])
    assert a.block_ids == (first,) and b.block_ids == (first + 1,)
    expected = [first * block_size + i for i in range(3)] + [(first + 1) * block_size + i for i in range(2)]
    assert min(expected) >= 2**31
    assert attn.slot_mapping.tolist() == expected
    # a step that crosses a block boundary
    attn = builder.build([(a, block_size)])
    assert a.block_ids == (first, first + 2)
    slots = attn.slot_mapping.tolist()
    assert slots == [first * block_size + i for i in range(3, block_size)] + [
        (first + 2) * block_size + i for i in range(3)
    ]
    assert attn.block_tables.tolist() == [[first, first + 2]]
    builder.check_integrity()


def _plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of q (L, H, D) at the last L positions of k, v (N, KVH, D)."""
    num_q, num_heads, head_dim = q.shape
    num_kv, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # (N, H, D)
    v = v.repeat_interleave(group, dim=1)  # (N, H, D)
    scores = torch.einsum("lhd,nhd->hln", q.double(), k.double()) * head_dim**-0.5  # (H, L, N)
    q_pos = torch.arange(num_kv - num_q, num_kv)[:, None]  # (L, 1)
    scores = scores.masked_fill(torch.arange(num_kv)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hln,nhd->lhd", scores.softmax(-1), v.double()).float()  # (L, H, D)


@pytest.mark.parametrize("backend,kernels", [("torch", "reference"), ("triton", "reference"), ("triton", "triton")])
def test_end_to_end_through_the_kernels(backend: str, kernels: str) -> None:
    """Write K/V through the slot mapping, attend through the block tables, compare with plain attention."""
    if kernels == "triton":
        from helexa.kernels.attention import paged_attention_triton as paged_attention
        from helexa.kernels.kv_write import write_kv_triton as write_kv
    else:
        write_kv, paged_attention = reference.write_kv, reference.paged_attention
    torch.manual_seed(1)
    block_size, num_kv_heads, num_heads, head_dim = 4, 2, 4, 8
    pool = BlockPool(48, block_size, 1, num_kv_heads, head_dim, torch.float32, "cpu", backend=backend)
    builder = BatchBuilder(pool, max_num_seqs=4, max_model_len=64)
    # scatter the free stack so tables are not contiguous
    scattered = pool.allocate(20).tolist()
    pool.free(scattered[1::2])
    k_cache, v_cache = pool.kv_caches()[0]
    history: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    tables = [builder.new_table() for _ in range(3)]
    # prefill chunks, decodes and a sequence that ends and is replaced
    steps = [
        [(0, 7), (1, 1), (2, 12)],
        [(0, 1), (1, 9), (2, 1)],
        [(2, 5), (0, 1)],
        "release 1",
        [(1, 3), (0, 6), (2, 1)],
        [(0, 1), (1, 1), (2, 1)],
    ]
    for step in steps:
        if isinstance(step, str):
            pool.decref(builder.release(tables[1]))
            history.pop(1, None)
            tables[1] = builder.new_table()
            continue
        attn = builder.build([(tables[i], n) for i, n in step])
        total = attn.num_tokens
        k_new = torch.randn(total, num_kv_heads, head_dim)
        v_new = torch.randn(total, num_kv_heads, head_dim)
        q = torch.randn(total, num_heads, head_dim)
        write_kv(k_new, v_new, k_cache, v_cache, attn.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc)
        start = 0
        for i, n in step:
            ks, vs = history.setdefault(i, ([], []))
            ks.append(k_new[start : start + n])
            vs.append(v_new[start : start + n])
            expected = _plain_attention(q[start : start + n], torch.cat(ks), torch.cat(vs))
            torch.testing.assert_close(out[start : start + n], expected, rtol=1e-4, atol=1e-5)
            start += n
        builder.check_integrity()


@pytest.mark.parametrize("seed", range(6))
def test_host_extend_equals_the_torch_ops(seed: int) -> None:
    """The CPU's NumPy extend and the torch ops (CUDA's torch backend) leave the same state and emit the
    same tables and slots, for random batches of prefills, extends and decodes popping random counts."""
    from helexa.kernels import block_alloc

    g = torch.Generator().manual_seed(seed)
    num_blocks, block_size, rows_total, max_blocks = 64, 4, 8, 12
    batch = int(torch.randint(1, rows_total + 1, (1,), generator=g))
    rows = torch.randperm(rows_total, generator=g)[:batch].to(torch.int32)
    old_lens = torch.randint(0, 20, (batch,), generator=g)
    q_lens = torch.randint(0, 9, (batch,), generator=g)
    q_lens[0] = max(1, int(q_lens[0]))
    lens = old_lens + q_lens
    need = (lens + block_size - 1) // block_size - (old_lens + block_size - 1) // block_size  # (B,)
    top = int(need.sum()) + int(torch.randint(0, 10, (1,), generator=g))
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)

    class State:
        def __init__(self) -> None:
            self.stack = perm.clone()
            self.refcount = torch.zeros(num_blocks, dtype=torch.int32)
            self.refcount[perm[top:].long()] = 1
            self.top_counter = torch.tensor([top], dtype=torch.int32)
            self.use_triton = False
            self.tables = torch.randint(
                0,
                num_blocks,
                (rows_total, max_blocks),
                generator=torch.Generator().manual_seed(seed),
                dtype=torch.int32,
            )

    host, ops = State(), State()
    total_new = int(need.sum())

    def step(state: State) -> block_alloc.ExtendStep:
        return block_alloc.ExtendStep(
            top, total_new, state.tables, rows, lens.to(torch.int32),
            torch.cat((torch.zeros(1, dtype=torch.long), q_lens.cumsum(0))).to(torch.int32),
            torch.cat((torch.zeros(1, dtype=torch.long), need.cumsum(0)[:-1])).to(torch.int32),
            int(((lens + block_size - 1) // block_size).max()), int(q_lens.sum()), block_size,
        )  # fmt: skip

    got, want = block_alloc._extend_numpy(host, step(host)), block_alloc._extend_torch(ops, step(ops))
    for a, b in [*zip(got, want), (host.tables, ops.tables), (host.refcount, ops.refcount)]:
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(host.stack, ops.stack) and int(host.top_counter) == int(ops.top_counter) == top - total_new
