"""One tier's index: which blocks it holds, in the order it would drop them, and the bytes they take.

Each tier (host memory, disk) keeps its own `TierIndex`: a block is found by its chained hash (the
prefix cache's `block_hash`, salt included) and verified by its tokens and its parent's hash. Drop
order, O(1) each: blocks whose session retention ran out, then the least recently used un-retained
blocks, then retained blocks, oldest first — so a retained session's blocks are the last to leave a tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["TierBlock", "TierIndex"]


@dataclass(eq=False)
class TierBlock:
    """One full block kept below the pool: its chain `hash`, the chain value before it (`parent`: the parent
    block's hash, or the salt's root hash for a prompt's first block, `first`), its `tokens`, the bytes it
    takes in its tier (`nbytes`) and until when (monotonic seconds) an agent session retains it."""

    hash: int
    parent: int
    first: bool
    tokens: tuple[int, ...]
    nbytes: int
    retain_until: float = 0.0

    def matches(self, parent: int, tokens: Sequence[int]) -> bool:
        """True when this block continues the chain value `parent` with exactly `tokens`."""
        return self.parent == parent and self.tokens == tuple(tokens)


class TierIndex:
    """The blocks of one tier with a byte budget (`capacity_bytes`); see the module docstring for the drop order.

    Guarantees: `nbytes` is the sum of its blocks' `nbytes` and never exceeds `capacity_bytes` after `add`;
    every block is in exactly one of its two lists (`check_integrity`). Not thread-safe: its tier's lock guards it.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"a tier's capacity must be >= 1 byte, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self._plain: OrderedDict[int, TierBlock] = OrderedDict()  # oldest use first
        self._retained: OrderedDict[int, TierBlock] = OrderedDict()  # earliest expiry first

    def __len__(self) -> int:
        return len(self._plain) + len(self._retained)

    def __iter__(self) -> Iterator[TierBlock]:
        """Every block, in drop order for a clock that reads 0 (un-retained ones first)."""
        yield from self._plain.values()
        yield from self._retained.values()

    def get(self, h: int) -> TierBlock | None:
        """The block with chain hash `h`, or None."""
        return self._plain.get(h) or self._retained.get(h)

    def add(self, block: TierBlock, now: float) -> list[TierBlock]:
        """Add `block` (its hash not held yet), dropping blocks in drop order until it fits; returns the dropped
        ones. A block larger than the whole budget is not added: it is returned as dropped itself."""
        if self.get(block.hash) is not None:
            raise ValueError(f"block {block.hash:#x} is already in this tier")
        if block.nbytes > self.capacity_bytes:
            return [block]
        dropped = []
        while self.nbytes + block.nbytes > self.capacity_bytes:
            dropped.append(self._pop_victim(now))
        self._list(block, now).__setitem__(block.hash, block)
        self.nbytes += block.nbytes
        return dropped

    def touch(self, block: TierBlock, retain_until: float, now: float) -> None:
        """`block` was used again: it moves to the back of its drop order, retained until `retain_until` if later."""
        self._unlist(block)
        block.retain_until = max(block.retain_until, retain_until)
        self._list(block, now)[block.hash] = block

    def remove(self, h: int) -> TierBlock | None:
        """Take the block with hash `h` out (None when it is not here)."""
        block = self.get(h)
        if block is not None:
            self._unlist(block)
            self.nbytes -= block.nbytes
        return block

    def check_integrity(self) -> None:
        """Raise `RuntimeError` unless the byte count and the lists agree."""
        if set(self._plain) & set(self._retained):
            raise RuntimeError("tier: a block is in both drop lists")
        total = sum(b.nbytes for b in self)
        if total != self.nbytes or self.nbytes > self.capacity_bytes:
            raise RuntimeError(f"tier: {self.nbytes} bytes counted, {total} held, capacity {self.capacity_bytes}")

    def _list(self, block: TierBlock, now: float) -> OrderedDict[int, TierBlock]:
        return self._retained if block.retain_until > now else self._plain

    def _unlist(self, block: TierBlock) -> None:
        if self._plain.pop(block.hash, None) is None:
            del self._retained[block.hash]

    def _pop_victim(self, now: float) -> TierBlock:
        if self._retained:
            first = next(iter(self._retained.values()))
            if first.retain_until <= now or not self._plain:
                victim = self._retained.popitem(last=False)[1]
                self.nbytes -= victim.nbytes
                return victim
        victim = self._plain.popitem(last=False)[1]
        self.nbytes -= victim.nbytes
        return victim
