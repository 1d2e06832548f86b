"""The host-memory tier: blocks' K/V kept in RAM (pinned when the pool is on CUDA), with its own LRU and budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helexa.kvcache.tiers.index import TierBlock, TierIndex

__all__ = ["HostTier", "TierCounters"]


@dataclass
class TierCounters:
    """A tier's totals since start: blocks found by lookups (`hits`), read back into the pool (`loads`), written
    into it (`writes`), that left it for good or for a lower tier (`drops`), and reads or writes that failed or
    did not verify (`failures`: each one a miss, never wrong KV)."""

    hits: int = 0
    loads: int = 0
    writes: int = 0
    drops: int = 0
    failures: int = 0


class HostTier:
    """Blocks' K/V in host memory, `capacity_bytes` at most. On CUDA each block is a pinned tensor, so a load is
    one asynchronous copy to the device; on a CPU the pool is host memory already and this tier is a second,
    slower-to-fill copy of it (useful for tests and when RAM outside the pool's budget is free).

    Not thread-safe: the `KVTiers` that owns it holds its lock around every call.
    """

    name = "host"
    medium = "CPU_HOST"  # vLLM's name for KV offloaded to host memory

    def __init__(self, capacity_bytes: int, *, pin: bool = False) -> None:
        self.index = TierIndex(capacity_bytes)
        self.counters = TierCounters()
        self._pin = pin
        self._data: dict[int, torch.Tensor] = {}

    def put(self, block: TierBlock, payload: torch.Tensor, now: float) -> list[tuple[TierBlock, torch.Tensor]]:
        """Keep `payload` ((num_layers, 2, block_size, num_kv_heads, head_dim), a copy it may keep) for `block`;
        returns the blocks dropped to make room, each with its K/V (the block itself when it can never fit)."""
        dropped = self.index.add(block, now)
        out = []
        for victim in dropped:
            data = payload if victim is block else self._data.pop(victim.hash)
            out.append((victim, data))
        if not dropped or dropped[-1] is not block:
            self._data[block.hash] = _pinned(payload) if self._pin else payload.clone()  # never a view of a batch
            self.counters.writes += 1
        self.counters.drops += len(dropped)
        return out

    def read(self, block: TierBlock) -> torch.Tensor | None:
        """The block's K/V (the tier's own tensor: copy it, never change it), or None when it is not here."""
        return self._data.get(block.hash) if self.index.get(block.hash) is block else None

    def discard(self, h: int) -> TierBlock | None:
        """Drop the block with hash `h` (None when it is not here)."""
        block = self.index.remove(h)
        if block is not None:
            del self._data[h]
        return block

    def check_integrity(self) -> None:
        self.index.check_integrity()
        if set(self._data) != {b.hash for b in self.index}:
            raise RuntimeError("host tier: data and index disagree")

    def close(self) -> None:
        """Nothing to stop: the tier lives and ends with the process."""


def _pinned(t: torch.Tensor) -> torch.Tensor:
    if t.is_pinned():
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out
