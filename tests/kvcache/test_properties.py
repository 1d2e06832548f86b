"""Hypothesis: random sequences of allocate/free/incref/decref/extend keep every invariant, and the
torch and Triton (interpreter) allocators agree with each other and with a plain-Python model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helexa.kvcache import BatchBuilder, BlockPool, OutOfBlocks

NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, MAX_LEN = 12, 4, 3, 24


class Model:
    """The allocator's contract in a few lines of Python: LIFO free stack, reference counts, tables."""

    def __init__(self) -> None:
        self.free = list(range(NUM_BLOCKS - 1, -1, -1))
        self.refs = [0] * NUM_BLOCKS
        self.tables: dict[int, list] = {}  # table key -> [block ids, num tokens]

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise OutOfBlocks(n, len(self.free), NUM_BLOCKS)
        out = [self.free.pop() for _ in range(n)]
        for b in out:
            self.refs[b] = 1
        return out

    def release(self, ids: list[int]) -> None:
        if any(not 0 <= b < NUM_BLOCKS or self.refs[b] == 0 for b in ids) or len(set(ids)) < len(ids):
            raise ValueError
        for b in ids:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)

    def incref(self, ids: list[int]) -> None:
        if any(not 0 <= b < NUM_BLOCKS or self.refs[b] == 0 for b in ids) or len(set(ids)) < len(ids):
            raise ValueError
        for b in ids:
            self.refs[b] += 1

    def build(self, batch: list[tuple[int, int]]) -> tuple[list[int], list[list[int]]]:
        need = sum(-(-(self.tables[k][1] + n) // BLOCK_SIZE) - len(self.tables[k][0]) for k, n in batch)
        if need > len(self.free):
            raise OutOfBlocks(need, len(self.free), NUM_BLOCKS)
        slots, rows = [], []
        for k, n in batch:
            ids, length = self.tables[k]
            while len(ids) * BLOCK_SIZE < length + n:
                ids.extend(self.allocate(1))
            slots += [ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length, length + n)]
            self.tables[k][1] = length + n
            rows.append(list(ids))
        width = max(len(r) for r in rows)
        return slots, [r + [0] * (width - len(r)) for r in rows]


def _outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except OutOfBlocks as e:
        return "OutOfBlocks", (e.requested, e.free, e.total)
    except ValueError:
        return "ValueError", None


def _state(pool: BlockPool) -> tuple:
    a = pool.allocator
    top = int(a.top_counter.item())
    return top, a.stack[:top].tolist(), a.refcount.tolist()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_operations_keep_invariants_and_backends_agree(data: st.DataObject) -> None:
    pools = [BlockPool(NUM_BLOCKS, BLOCK_SIZE, 1, 1, 4, torch.float32, "cpu", backend=b) for b in ("torch", "triton")]
    builders = [BatchBuilder(p, max_num_seqs=MAX_SEQS, max_model_len=MAX_LEN) for p in pools]
    model = Model()
    tables: dict[int, list] = {}  # key -> [torch table, triton table]
    next_key = 0
    loose: dict[int, int] = {}  # references the test holds outside tables: block id -> count

    for _ in range(data.draw(st.integers(1, 12), label="num_ops")):
        op = data.draw(st.sampled_from(["allocate", "free", "decref", "incref", "new_table", "release", "build"]))
        if op == "allocate":
            n = data.draw(st.integers(0, 5), label="n")
            results = [_outcome(lambda p=p, n=n: p.allocate(n).tolist()) for p in pools]
            expected = _outcome(model.allocate, n)
            if expected[0] == "ok":
                loose.update((b, 1) for b in expected[1])
        elif op in ("free", "decref", "incref"):
            # Valid ids are references the test holds itself (freeing a block a table holds would
            # break the table, which only BatchBuilder.check_integrity can see); invalid ones are
            # free blocks, out-of-range ids and repeats. Incref may share any allocated block.
            held = sorted(loose) if op != "incref" else [b for b in range(NUM_BLOCKS) if model.refs[b]]
            free_now = [b for b in range(NUM_BLOCKS) if model.refs[b] == 0]
            pick = st.sampled_from(held) if held else st.nothing()
            bad = st.sampled_from(free_now + [-1, NUM_BLOCKS]) if free_now else st.sampled_from([-1, NUM_BLOCKS])
            invalid = bool(held) and data.draw(st.booleans(), label="invalid")
            some = st.lists(pick | bad if invalid else pick, max_size=4) if held else st.lists(bad, max_size=2)
            ids = data.draw(some, label="ids")
            results = [_outcome(getattr(p, op), ids) for p in pools]
            expected = _outcome(model.incref if op == "incref" else model.release, ids)
            if expected[0] == "ok":
                for b in ids:
                    loose[b] = loose.get(b, 0) + (1 if op == "incref" else -1)
                    if loose[b] == 0:
                        del loose[b]
        elif op == "new_table":
            if len(tables) == MAX_SEQS:
                continue
            tables[next_key] = [b.new_table() for b in builders]
            model.tables[next_key] = [[], 0]
            next_key += 1
            results, expected = [("ok", None)] * 2, ("ok", None)
        elif op == "release":
            if not tables:
                continue
            key = data.draw(st.sampled_from(sorted(tables)), label="release")
            for p, b, t in zip(pools, builders, tables.pop(key)):
                p.decref(b.release(t))
            ids, _ = model.tables.pop(key)
            model.release(ids)
            results, expected = [("ok", None)] * 2, ("ok", None)
        else:
            if not tables:
                continue
            keys = data.draw(st.lists(st.sampled_from(sorted(tables)), min_size=1, unique=True), label="batch")
            counts = [data.draw(st.integers(1, max(1, min(6, MAX_LEN - model.tables[k][1]))), label="n") for k in keys]
            if any(model.tables[k][1] + n > MAX_LEN for k, n in zip(keys, counts)):
                continue
            results = []
            for i, b in enumerate(builders):
                outcome = _outcome(b.build, [(tables[k][i], n) for k, n in zip(keys, counts)])
                if outcome[0] == "ok":
                    attn = outcome[1]
                    outcome = ("ok", (attn.slot_mapping.tolist(), attn.block_tables.tolist()))
                results.append(outcome)
            expected = _outcome(model.build, list(zip(keys, counts)))

        assert results[0] == results[1] == expected, (op, results, expected)
        for pool, builder in zip(pools, builders):
            builder.check_integrity()
            assert pool.num_free_blocks == len(model.free)
        assert _state(pools[0]) == _state(pools[1]) == (len(model.free), model.free, model.refs)
        for key, (ids, length) in model.tables.items():
            assert [list(t.block_ids) for t in tables[key]] == [ids, ids]
            assert [t.num_tokens for t in tables[key]] == [length, length]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_everything_returns_after_all_sequences_end(backend: str) -> None:
    """After every table is released and loose blocks are freed, every block is free again."""
    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE, 1, 1, 4, torch.float32, "cpu", backend=backend)
    builder = BatchBuilder(pool, max_num_seqs=MAX_SEQS, max_model_len=MAX_LEN)
    loose = pool.allocate(2).tolist()
    pool.incref(loose)  # b's own references to them
    a, b = builder.new_table(), builder.new_table(loose)
    builder.build([(a, 5), (b, 3)])
    pool.incref(a.block_ids[:1])  # c's reference to a's first block
    c = builder.new_table(a.block_ids[:1])
    builder.build([(c, 9), (a, 1)])
    pool.free(loose)
    for t in (a, b, c):
        pool.decref(builder.release(t))
    builder.check_integrity()
    assert pool.num_free_blocks == NUM_BLOCKS and builder.num_live_tables == 0
    assert pool.allocator.refcount.sum().item() == 0
