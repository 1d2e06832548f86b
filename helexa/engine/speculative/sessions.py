"""The earlier outputs of agent sessions, kept as a draft source for their next turns.

A session is a request's `(cache_salt, prompt_cache_key)`: the salt is the tenant boundary, so one
tenant's text is never drafted into another's request, exactly as the prefix cache never shares a
block across salts. Each session keeps its latest outputs (at most `max_session_tokens` tokens) in one
int32 array, separated by a marker no token equals, with an `NgramIndex` over it; all sessions together
keep at most `max_tokens` tokens, the least recently used session going first (by default 16k tokens a
session and 256k in all: ~60 bytes a token with the compiled index, so ~15 MiB at most; ~470 with the
index in Python dicts).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from helexa.engine.speculative.ngram import NgramIndex
from helexa.values import check_int

__all__ = ["SessionOutputs"]

_SEPARATOR = -1  # between two outputs in a session's list: no n-gram spans it, no draft contains it

SessionKey = tuple[str | None, Hashable]


@dataclass
class _Session:
    tokens: array = field(default_factory=lambda: array("i"))
    index: NgramIndex | None = None


class SessionOutputs:
    """Bounded memory of each session's earlier outputs (see the module docstring). Engine thread only.

    Guarantees: `propose` returns only tokens one earlier output of the same `(salt, session)` produced,
    never a separator; the store never holds more than `max_tokens` tokens in all, nor a session more
    than `max_session_tokens` (its oldest outputs are dropped first, then whole sessions, least recently
    used first)."""

    def __init__(
        self,
        *,
        min_n: int = 2,
        max_n: int = 4,
        max_session_tokens: int = 16_384,
        max_tokens: int = 1 << 18,
        native: bool | None = None,
    ) -> None:
        """`native`: which tables the sessions' indexes keep (`NgramIndex`'s argument)."""
        self.min_n, self.max_n, self.native = min_n, max_n, native
        self.max_session_tokens = check_int(max_session_tokens, "max_session_tokens", 2)
        self.max_tokens = check_int(max_tokens, "max_tokens", 1)
        self._sessions: OrderedDict[SessionKey, _Session] = OrderedDict()
        self._total = 0

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def num_tokens(self) -> int:
        """Tokens kept, separators included."""
        return self._total

    def record(self, salt: str | None, session: Hashable, output: Sequence[int]) -> None:
        """Keep a finished request's output (its last `max_session_tokens` tokens at most) for its session."""
        if not output:
            return
        key = (salt, session)
        s = self._sessions.pop(key, None) or _Session()
        self._total -= len(s.tokens)
        s.tokens.extend(array("i", [*output[-self.max_session_tokens + 1 :], _SEPARATOR]))
        if len(s.tokens) > self.max_session_tokens:  # drop the oldest outputs whole: cut after a separator
            cut = len(s.tokens) - self.max_session_tokens
            while cut < len(s.tokens) and s.tokens[cut - 1] != _SEPARATOR:
                cut += 1
            s.tokens = s.tokens[cut:]
            s.index = None  # positions moved: indexed afresh on the next lookup
        self._sessions[key] = s
        self._total += len(s.tokens)
        while self._total > self.max_tokens and len(self._sessions) > 1:
            _, old = self._sessions.popitem(last=False)
            self._total -= len(old.tokens)

    def propose(self, salt: str | None, session: Hashable, tail: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to `k` tokens that followed `tail`'s longest suffix (of `min_n` to `max_n` tokens) in one of the
        session's earlier outputs, the latest such occurrence first; () when none, or no such session."""
        s = self._sessions.get((salt, session))
        if s is None or k <= 0:
            return ()
        self._sessions.move_to_end((salt, session))
        if s.index is None:
            s.index = NgramIndex(self.min_n, self.max_n, native=self.native)
        s.index.extend(s.tokens)
        draft = s.index.continuation(s.tokens, tail, k)
        return draft[: draft.index(_SEPARATOR)] if _SEPARATOR in draft else draft
