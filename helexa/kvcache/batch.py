"""Block tables and the per-step batch builder: grow each sequence's table, emit `AttentionMetadata`.

The engine's whole use, once per step:

    builder = BatchBuilder(pool, max_num_seqs=256, max_model_len=8192)
    table = builder.new_table()                        # when a sequence starts running
    attn = builder.build([(table, 7), (other, 1)])     # every step: (table, new tokens) pairs
    ... model forward with attn and pool.kv_caches() ...
    builder.release(table)                             # when the sequence ends (or is preempted)

`build` extends every table by the blocks its new tokens need (allocating them from the pool),
and returns the step's `AttentionMetadata` in one call. Its device work is one host-to-device
copy of 4B+1 int32s and one allocator launch (a Triton kernel on CUDA); nothing is read back, so
it never waits for the device. The host knows every block id from the allocator's mirror, so a
`BlockTable` always lists its blocks without a sync.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from helexa.kvcache.allocator import BlockIds, OutOfBlocks
from helexa.kvcache.metadata import AttentionMetadata
from helexa.kvcache.pool import BlockPool

__all__ = ["BlockTable", "BatchBuilder"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockTable:
    """One sequence's blocks, in order: token `i` lives in block `block_ids[i // block_size]`.

    Created by `BatchBuilder.new_table`, grown only by `BatchBuilder.build`, ended by
    `BatchBuilder.release`. `num_tokens` counts the tokens with a slot (context so far); the
    table always holds exactly `cdiv(num_tokens, block_size)` blocks. The ids are a host copy of
    row `row` of the builder's device table.
    """

    __slots__ = ("_builder", "row", "_block_ids", "num_tokens", "_released")

    def __init__(self, builder: BatchBuilder, row: int, block_ids: list[int], num_tokens: int) -> None:
        self._builder = builder
        self.row = row
        self._block_ids = block_ids
        self.num_tokens = num_tokens
        self._released = False

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The sequence's block ids, in position order."""
        return tuple(self._block_ids)

    @property
    def num_blocks(self) -> int:
        """Blocks held: `cdiv(num_tokens, block_size)`."""
        return len(self._block_ids)

    @property
    def released(self) -> bool:
        """True once `BatchBuilder.release` returned the table's blocks."""
        return self._released

    def blocks_needed(self, num_new_tokens: int) -> int:
        """Blocks that `num_new_tokens` more tokens would add to this table."""
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative int, got {num_new_tokens!r}")
        block_size = self._builder.pool.block_size
        return _cdiv(self.num_tokens + num_new_tokens, block_size) - len(self._block_ids)

    def __repr__(self) -> str:
        state = ", released" if self._released else ""
        return f"BlockTable(row={self.row}, num_tokens={self.num_tokens}, block_ids={self._block_ids}{state})"


class BatchBuilder:
    """Owns the device block tables of up to `max_num_seqs` sequences and builds each step's metadata.

    `tables` is a (max_num_seqs, cdiv(max_model_len, block_size)) int32 tensor on the pool's
    device; each live `BlockTable` owns one row. Guarantees (checked by `check_integrity`): each
    live table's device row starts with its host block ids; every block a table lists holds a
    reference for it; `num_blocks == cdiv(num_tokens, block_size)`.
    Not thread-safe: the engine thread owns it.
    """

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_model_len: int) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = _cdiv(max_model_len, pool.block_size)
        self.tables = torch.zeros(
            max_num_seqs, self.max_blocks_per_seq, dtype=torch.int32, device=pool.device
        )  # (max_num_seqs, max_blocks_per_seq)
        self._free_rows: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self._live: dict[int, BlockTable] = {}

    @property
    def num_live_tables(self) -> int:
        """Tables created and not yet released."""
        return len(self._live)

    # ---------------------------------------------------------------- table lifecycle

    def new_table(self, shared_blocks: BlockIds = ()) -> BlockTable:
        """A table for a new sequence, empty or starting with full blocks shared with others.

        `shared_blocks` (allocated, e.g. by the prefix cache) gain one reference each and become
        the table's first blocks, holding `len(shared_blocks) * block_size` tokens. Raises
        `ValueError` when all `max_num_seqs` rows are in use or a shared block is invalid.
        """
        if not self._free_rows:
            raise ValueError(f"all {self.max_num_seqs} block-table rows are in use (max_num_seqs)")
        ids = shared_blocks.tolist() if isinstance(shared_blocks, torch.Tensor) else list(shared_blocks)
        if len(ids) > self.max_blocks_per_seq:
            raise ValueError(f"{len(ids)} shared blocks exceed max_model_len {self.max_model_len}")
        self.pool.incref(ids)  # validates before any change
        row = self._free_rows.pop()
        if ids:
            self.tables[row, : len(ids)] = torch.tensor(ids, dtype=torch.int32).to(self.pool.device, non_blocking=True)
        table = BlockTable(self, row, ids, len(ids) * self.pool.block_size)
        self._live[row] = table
        return table

    def release(self, table: BlockTable) -> None:
        """Drop the table's reference to each of its blocks and free its row (no device sync).

        Blocks no one else holds return to the pool. Releasing a table twice raises `ValueError`.
        """
        self._check_live(table)
        self.pool.decref(table._block_ids)
        table._released = True
        del self._live[table.row]
        self._free_rows.append(table.row)

    # ---------------------------------------------------------------- per step

    def blocks_needed(self, batch: Iterable[tuple[BlockTable, int]]) -> int:
        """Blocks `build(batch)` would allocate (the check half of check/commit)."""
        return sum(table.blocks_needed(n) for table, n in batch)

    def can_build(self, batch: Iterable[tuple[BlockTable, int]]) -> bool:
        """True when the pool has the blocks `build(batch)` needs now."""
        return self.blocks_needed(batch) <= self.pool.num_free_blocks

    def build(self, batch: Sequence[tuple[BlockTable, int]]) -> AttentionMetadata:
        """Extend each (table, num_new_tokens) by the blocks its new tokens need; return the step's metadata.

        Sequences appear in the metadata in the order given; sequence b's new tokens are
        `query_start_loc[b]:query_start_loc[b+1]` and take the positions after its current
        `num_tokens`. New blocks are allocated in batch order. Returns `AttentionMetadata` with
        `slot_mapping` (T,) int64, `block_tables` (B, max new blocks) int32 padded with 0,
        `seq_lens` (B,) int32 (including the new tokens), `query_start_loc` (B+1,) int32.
        Raises `OutOfBlocks` when the pool lacks the blocks, `ValueError` for an empty batch, a
        repeated or released table, a count < 1 or a sequence beyond `max_model_len`; in every
        error case nothing changes. No device synchronisation.
        """
        entries = list(batch)
        if not entries:
            raise ValueError("build needs at least one (table, num_new_tokens) pair")
        block_size = self.pool.block_size
        query_start_loc = [0]
        seq_lens: list[int] = []
        rows: list[int] = []
        alloc_start: list[int] = []
        new_blocks: list[int] = []
        total_new = 0
        seen_rows: set[int] = set()
        for table, n in entries:
            self._check_live(table)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"num_new_tokens must be an int >= 1, got {n!r} for {table!r}")
            if table.row in seen_rows:
                raise ValueError(f"{table!r} appears twice in one step")
            seen_rows.add(table.row)
            seq_len = table.num_tokens + n
            if seq_len > self.max_model_len:
                raise ValueError(
                    f"sequence in row {table.row} would reach {seq_len} tokens, over max_model_len {self.max_model_len}"
                )
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(seq_len)
            rows.append(table.row)
            alloc_start.append(total_new)
            blocks = -(-seq_len // block_size)
            new_blocks.append(blocks)
            total_new += blocks - len(table._block_ids)
        if total_new > self.pool.num_free_blocks:
            raise OutOfBlocks(total_new, self.pool.num_free_blocks, self.pool.num_blocks)

        num_seqs = len(entries)
        num_tokens = query_start_loc[-1]
        width = max(new_blocks)
        packed = torch.tensor(query_start_loc + seq_lens + rows + alloc_start, dtype=torch.int32)  # (4B+1,)
        packed = packed.to(self.pool.device, non_blocking=True)
        qsl_d = packed[: num_seqs + 1]  # (B+1,)
        seq_lens_d = packed[num_seqs + 1 : 2 * num_seqs + 1]  # (B,)
        rows_d = packed[2 * num_seqs + 1 : 3 * num_seqs + 1]  # (B,)
        alloc_start_d = packed[3 * num_seqs + 1 :]  # (B,)

        popped, block_tables, slot_mapping = self.pool.allocator.extend_tables(
            total_new, self.tables, rows_d, seq_lens_d, qsl_d, alloc_start_d, width, num_tokens, block_size
        )
        for (table, _), start, seq_len, blocks in zip(entries, alloc_start, seq_lens, new_blocks):
            need = blocks - len(table._block_ids)
            if need:
                table._block_ids.extend(popped[start : start + need])
            table.num_tokens = seq_len
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens_d,
            query_start_loc=qsl_d,
            max_query_len=max(n for _, n in entries),
            max_seq_len=max(seq_lens),
        )

    # ---------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Raise `RuntimeError` unless the pool's and every live table's invariants hold (syncs)."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        rows = self.tables.tolist()
        for row, table in self._live.items():
            expected = _cdiv(table.num_tokens, self.pool.block_size)
            if len(table._block_ids) != expected:
                raise RuntimeError(f"{table!r}: {len(table._block_ids)} blocks for {table.num_tokens} tokens, expected {expected}")
            if rows[row][: len(table._block_ids)] != table._block_ids:
                raise RuntimeError(f"{table!r}: device row {rows[row][: len(table._block_ids)]} differs")
            for b in table._block_ids:
                holders[b] = holders.get(b, 0) + 1
        for b, count in holders.items():
            if self.pool.refcount(b) < count:
                raise RuntimeError(f"block {b} is held by {count} tables but has refcount {self.pool.refcount(b)}")
        if len(self._live) + len(self._free_rows) != self.max_num_seqs:
            raise RuntimeError("block-table rows lost or duplicated")

    def _check_live(self, table: BlockTable) -> None:
        if not isinstance(table, BlockTable) or table._builder is not self:
            raise ValueError(f"{table!r} does not belong to this BatchBuilder")
        if table._released or self._live.get(table.row) is not table:
            raise ValueError(f"{table!r} was released")
