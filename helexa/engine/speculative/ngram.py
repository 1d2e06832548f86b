"""Prompt lookup: the tokens that followed the latest earlier occurrence of a sequence's last n tokens.

    index = NgramIndex(min_n=2, max_n=4)
    draft = index.propose(tokens, k=8)   # tokens: the sequence's prompt + output so far (it only grows)

An agent that rewrites a file it has read, repeats a diff or echoes JSON produces runs of tokens that
already occur earlier in its context; after their first few tokens the rest can be read off. The index
keeps, for each n in `[min_n, max_n]`, the position that followed the latest occurrence of every n-gram,
updated incrementally as the list grows: a lookup costs O(max_n) and indexing O(max_n) per new token,
whatever the context's length.

Its memory grows with the context of every request that drafts (and of every session `SessionOutputs`
keeps), so it is held compactly: a copy of the indexed tokens (4 bytes each) and, per n, a hash table of
int32 positions at most half full whose keys are read from that copy (`csrc/ngram.c`, compiled on first
use like helexa's other C code): 28-52 bytes a token for n = 2..4. Where no C compiler is available the
same index is kept in Python dicts keyed by token tuples (the reference: the same answers, ~300-400
bytes a token).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from array import array
from collections.abc import Sequence
from pathlib import Path

from helexa.values import check_int

__all__ = ["NgramIndex", "compiled_tables", "native_unavailable_reason"]

_log = logging.getLogger("helexa.speculative")
_CSRC = Path(__file__).with_name("csrc")
_FLAGS = ("-O2", "-fPIC", "-shared")
_MIN_SLOTS = 16  # a table's first size (a power of two)


@functools.cache
def _native() -> tuple[ctypes.CDLL | None, str]:
    """(the compiled tables' library, "") or (None, why not): built once per process (see the module doc)."""
    from helexa import cbuild  # noqa: PLC0415 — only the first index of a process builds or loads it
    from helexa.model.weights.pull import helexa_home  # noqa: PLC0415

    try:
        library = cbuild.compile_library("ngram", [_CSRC / "ngram.c"], _FLAGS, out_dir=helexa_home() / "build")
        lib = ctypes.CDLL(str(library))
    except (OSError, RuntimeError) as exc:
        _log.warning("speculative: prompt lookup keeps its index in Python dicts (no compiled tables: %s)", exc)
        return None, str(exc)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.helexa_ngram_extend.argtypes = [p, p, i64, i64]
    lib.helexa_ngram_extend.restype = None
    lib.helexa_ngram_lookup.argtypes = [p, p, p, i64, i64]
    lib.helexa_ngram_lookup.restype = i64
    return lib, ""


def compiled_tables() -> bool:
    """True when indexes made with `native=None` use the compiled tables. The first call in a process builds
    or loads them (a build, once per machine, takes a fraction of a second)."""
    return _native()[0] is not None


def native_unavailable_reason() -> str:
    """Why indexes keep Python dicts in this process ("" when the compiled tables are in use)."""
    return _native()[1]


class _CompiledTables:
    """The tables of `csrc/ngram.c`: per n, an `array('i')` of `cap` slots (-1 empty) whose keys are in the
    token copy. This object owns their memory; `cap` stays at least twice the positions indexed, so no
    table is ever more than half full. `_layout` is what the C side reads: min_n, the table count, cap and
    the address of the tables' addresses."""

    __slots__ = ("_lib", "min_n", "_tables", "_addresses", "_layout", "_at")

    def __init__(self, lib: ctypes.CDLL, min_n: int, count: int) -> None:
        self._lib, self.min_n = lib, min_n
        self._tables = [array("i", [-1]) * _MIN_SLOTS for _ in range(count)]
        self._addresses = array("Q", [t.buffer_info()[0] for t in self._tables])  # never resized: one address
        self._layout = array("q", [min_n, count, _MIN_SLOTS, self._addresses.buffer_info()[0]])
        self._at = self._layout.buffer_info()[0]

    def add(self, tokens: Sequence[int], copy: array, start: int, end: int) -> None:
        """Index the n-grams followed by a token at `start <= i < end` (`copy` holds the first `end` tokens)."""
        cap = self._layout[2]
        if 2 * end > cap:  # larger tables, indexed afresh from the first token
            while 2 * end > cap:
                cap *= 2
            self._tables = [array("i", [-1]) * cap for _ in self._tables]
            self._addresses[:] = array("Q", [t.buffer_info()[0] for t in self._tables])
            self._layout[2], start = cap, 0
        self._lib.helexa_ngram_extend(self._at, copy.buffer_info()[0], start, end)

    def find(self, copy: array, tail: array, end: int) -> int:
        """The position after the latest indexed occurrence of `tail`'s longest suffix (see NgramIndex),
        if it is below `end`; else -1."""
        return self._lib.helexa_ngram_lookup(self._at, copy.buffer_info()[0], tail.buffer_info()[0], len(tail), end)


class _DictTables:
    """The same tables as Python dicts, n-gram tuple -> position: the reference, and what runs without a C
    compiler."""

    __slots__ = ("min_n", "_maps")

    def __init__(self, min_n: int, count: int) -> None:
        self.min_n = min_n
        self._maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(count)]

    def add(self, tokens: Sequence[int], copy: array, start: int, end: int) -> None:
        for offset, table in enumerate(self._maps):
            n = self.min_n + offset
            for i in range(max(start, n), end):  # the n-gram tokens[i-n:i] was followed by tokens[i]
                table[tuple(tokens[i - n : i])] = i

    def find(self, copy: array, tail: array, end: int) -> int:
        for offset in range(len(self._maps) - 1, -1, -1):
            n = self.min_n + offset
            if n > len(tail):
                continue
            start = self._maps[offset].get(tuple(tail[len(tail) - n :]))
            if start is not None and start < end:
                return start
        return -1


class NgramIndex:
    """An incremental n-gram index over one token list that only grows (`propose` is given the same,
    longer list each time; a shorter list is indexed afresh).

    Guarantees: `propose(tokens, k)` returns at most `k` tokens, taken from `tokens` right after the
    latest occurrence, ending before the list's end, of its last `n` tokens, for the longest `n` in
    `[min_n, max_n]` with such an occurrence; an empty tuple when none exists. Where that occurrence is
    so recent that fewer than `k` tokens follow it (the text repeats with a period of `p` tokens), the
    draft goes on repeating that period up to `k` tokens. The returned tokens are
    what came next then, so they are only a guess: a verifier decides what is kept. Both kinds of tables
    (`native`: True the compiled ones, False Python dicts, None the compiled ones where they build) give
    the same answers. Token ids must fit in int32 (every vocabulary's do)."""

    __slots__ = ("min_n", "max_n", "_lib", "_tokens", "_tables", "_last_start")

    def __init__(self, min_n: int = 2, max_n: int = 4, *, native: bool | None = None) -> None:
        self.min_n = check_int(min_n, "min_n", 1)
        self.max_n = check_int(max_n, "max_n", self.min_n)
        self._lib, why = _native() if native is not False else (None, "")
        if native and self._lib is None:
            raise RuntimeError(f"the compiled n-gram tables are unavailable: {why}")
        self._tables = self._new_tables()
        # The list indexed so far: every n-gram followed by a token at a position < len(_tokens) is in the
        # tables, the n-gram ending at i (tokens[i-n:i]) mapped to i, the latest such i.
        self._tokens = array("i")
        self._last_start = 0  # where the last continuation began

    @property
    def native(self) -> bool:
        """True when this index's tables are the compiled ones."""
        return self._lib is not None

    def _new_tables(self) -> _CompiledTables | _DictTables:
        count = self.max_n - self.min_n + 1
        if self._lib is None:
            return _DictTables(self.min_n, count)
        return _CompiledTables(self._lib, self.min_n, count)

    def __len__(self) -> int:
        """Tokens indexed so far."""
        return len(self._tokens)

    def extend(self, tokens: Sequence[int], end: int | None = None) -> None:
        """Index every n-gram of `tokens[:end]` that is followed by a token inside `tokens[:end]` (`end`
        defaults to the whole list). The list must be the one indexed before, grown: a shorter one is
        indexed afresh."""
        end = len(tokens) if end is None else end
        if end < len(self._tokens):
            self._tokens, self._tables = array("i"), self._new_tables()
        start = len(self._tokens)
        if end > start:
            self._tokens.extend(array("i", tokens[start:end]))  # converted whole first: a bad id changes nothing
            self._tables.add(tokens, self._tokens, start, end)

    def propose(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching suffix of
        `tokens` (see the class docstring); indexes what it has not seen first."""
        if k <= 0 or len(tokens) < self.min_n:
            return ()
        self.extend(tokens)  # every n-gram followed by a known token: the list's own last n-gram is not
        draft = list(self._continuation(tokens, self._tokens[-self.max_n :], k))
        period = len(tokens) - self._last_start
        while draft and len(draft) < k:  # a match `period` tokens back: the text repeats, the draft too
            draft.append(draft[len(draft) - period])
        return tuple(draft)

    def continuation(self, text: Sequence[int], tail: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to `k` tokens of `text` (the list this index covers) that followed the latest indexed occurrence
        of the longest suffix of `tail` (any tokens, e.g. another sequence's last ones) of `min_n` to
        `max_n` tokens; an empty tuple when none is indexed. Indexes nothing."""
        return self._continuation(text, array("i", tail[-self.max_n :]), k)

    def _continuation(self, text: Sequence[int], tail: array, k: int) -> tuple[int, ...]:
        end = min(len(text), len(self._tokens))
        start = self._tables.find(self._tokens, tail, end)
        if start < 0:
            return ()
        self._last_start = start
        return tuple(text[start : min(start + k, end)])
