"""Prompt lookup: the tokens that followed the latest earlier occurrence of a sequence's last n tokens.

    index = NgramIndex(min_n=2, max_n=4)
    draft = index.propose(tokens, k=8)   # tokens: the sequence's prompt + output so far (it only grows)

An agent that rewrites a file it has read, repeats a diff or echoes JSON produces runs of tokens that
already occur earlier in its context; after their first few tokens the rest can be read off. The index
keeps, for each n in `[min_n, max_n]`, the position that followed the latest occurrence of every n-gram
(a dict per n), updated incrementally as the list grows: a lookup costs O(max_n) and indexing O(1) per
new token, whatever the context's length.
"""

from __future__ import annotations

from collections.abc import Sequence

from helexa.values import check_int

__all__ = ["NgramIndex"]


class NgramIndex:
    """An incremental n-gram index over one token list that only grows (`propose` is given the same,
    longer list each time; a list that shrank or changed before the indexed end is re-indexed).

    Guarantees: `propose(tokens, k)` returns at most `k` tokens, taken from `tokens` right after the
    latest occurrence, ending before the list's end, of its last `n` tokens, for the longest `n` in
    `[min_n, max_n]` with such an occurrence; an empty tuple when none exists. Where that occurrence is
    so recent that fewer than `k` tokens follow it (the text repeats with a period of `p` tokens), the
    draft goes on repeating that period up to `k` tokens. The returned tokens are
    what came next then, so they are only a guess: a verifier decides what is kept."""

    __slots__ = ("min_n", "max_n", "_maps", "_indexed", "_last_start")

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n = check_int(min_n, "min_n", 1)
        self.max_n = check_int(max_n, "max_n", self.min_n)
        self._maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_n - self.min_n + 1)]
        # Every n-gram followed by a token at a position < `_indexed` is in the maps: the n-gram ending
        # at i (tokens[i-n:i]) maps to i, the position of the token that followed it (the latest such i).
        self._indexed = 0
        self._last_start = 0  # where the last continuation began

    def __len__(self) -> int:
        """Tokens indexed so far."""
        return self._indexed

    def extend(self, tokens: Sequence[int], end: int | None = None) -> None:
        """Index every n-gram of `tokens[:end]` that is followed by a token inside `tokens[:end]` (`end`
        defaults to the whole list). The list must be the one indexed before, grown: a shorter one is
        indexed afresh."""
        end = len(tokens) if end is None else end
        if end < self._indexed:
            self._maps = [{} for _ in self._maps]
            self._indexed = 0
        start = self._indexed
        for offset, table in enumerate(self._maps):
            n = self.min_n + offset
            for i in range(max(start, n), end):  # the n-gram tokens[i-n:i] was followed by tokens[i]
                table[tuple(tokens[i - n : i])] = i
        self._indexed = max(start, end)

    def propose(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching suffix of
        `tokens` (see the class docstring); indexes what it has not seen first."""
        if k <= 0 or len(tokens) < self.min_n:
            return ()
        self.extend(tokens)  # every n-gram followed by a known token: the list's own last n-gram is not
        draft = list(self.continuation(tokens, tokens[-self.max_n :], k))
        period = len(tokens) - self._last_start
        while draft and len(draft) < k:  # a match `period` tokens back: the text repeats, the draft too
            draft.append(draft[len(draft) - period])
        return tuple(draft)

    def continuation(self, text: Sequence[int], tail: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to `k` tokens of `text` (the list this index covers) that followed the latest indexed occurrence
        of the longest suffix of `tail` (any tokens, e.g. another sequence's last ones) of `min_n` to
        `max_n` tokens; an empty tuple when none is indexed. Indexes nothing."""
        end = min(len(text), self._indexed)
        for offset in range(len(self._maps) - 1, -1, -1):
            n = self.min_n + offset
            if n > len(tail):
                continue
            start = self._maps[offset].get(tuple(tail[len(tail) - n :]))
            if start is not None and start < end:
                self._last_start = start
                return tuple(text[start : min(start + k, end)])
        return ()
