"""A bounded, thread-safe LRU cache for compiled grammars, keyed by the digest of their source text.

Compiling a schema or building a grammar's matcher takes from milliseconds to seconds, and agents
send the same schemas and tools on every turn, so both are kept; a hostile client sending a new
schema each time evicts old entries instead of growing memory: the cache never holds more than
`max_entries` entries nor more than `max_bytes` of their declared sizes (an entry larger than
`max_bytes` is not kept at all).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["BoundedCache", "digest"]

V = TypeVar("V")


def digest(*parts: str) -> str:
    """A collision-resistant key for `parts` (their SHA-256, each part's length included)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


class BoundedCache(Generic[V]):
    """Least-recently-used entries, at most `max_entries` of them and `max_bytes` of their sizes in all."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"a cache needs room: max_entries={max_entries}, max_bytes={max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get_or_build(self, key: str, build: Callable[[], V], size: Callable[[V], int]) -> V:
        """The value cached under `key`, else `build()` (called without the lock held: two threads may build
        the same value once each), kept when `size(value)` fits. `build`'s exceptions propagate, nothing kept."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[0]
        value = build()
        nbytes = size(value)
        with self._lock:
            if key in self._entries or nbytes > self.max_bytes:
                return value
            self._entries[key] = (value, nbytes)
            self._bytes += nbytes
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
        return value

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def entries(self) -> int:
        """How many entries are kept now."""
        with self._lock:
            return len(self._entries)

    @property
    def bytes(self) -> int:
        """The sizes of the kept entries, summed."""
        with self._lock:
            return self._bytes
