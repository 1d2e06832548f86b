"""What each decoding sequence proposes to verify this step, and how long a draft it tries.

`Drafter.propose(seq_tokens, state, limit)` reads the request's own tokens (prompt lookup, `NgramIndex`)
and, in mode `suffix`, its session's earlier outputs (`SessionOutputs`). Each request's `DraftState`
chooses the draft's length from what its own drafts recently kept: a draft that was kept whole doubles
the next one (up to `num_speculative_tokens`); one cut short makes the next one what was kept, plus one;
a request whose drafts keep nothing stops drafting for a while (2, 4, ... up to 64 steps), so text that
does not copy pays next to nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from helexa.engine.speculative.ngram import NgramIndex
from helexa.engine.speculative.sessions import SessionOutputs

__all__ = ["DraftState", "Drafter", "SpecStats", "SPECULATIVE_MODES"]

SPECULATIVE_MODES = ("off", "ngram", "suffix")
_MAX_BACKOFF_STEPS = 64


@dataclass
class SpecStats:
    """Totals since start (engine thread writes, any thread reads): verified drafts, their tokens, and how
    many of those tokens were kept. `acceptance_rate` = accepted / drafted tokens; `mean_accepted_length`
    = accepted tokens per verified draft (a step that verifies a draft emits that many, plus one)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.accepted_tokens / self.drafts if self.drafts else 0.0

    def snapshot(self) -> dict[str, float | int]:
        """The `/v1/admission` fields."""
        return {
            "spec_drafts": self.drafts,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_acceptance_rate": round(self.acceptance_rate, 4),
            "spec_mean_accepted_length": round(self.mean_accepted_length, 3),
        }


class DraftState:
    """One request's drafting: its prompt-lookup index and the adaptive draft length (see the module
    docstring). `next_length()` is the draft length to try now (0: skip this step)."""

    __slots__ = ("index", "length", "max_length", "_misses", "_skip")

    def __init__(self, min_n: int, max_n: int, max_length: int) -> None:
        self.index = NgramIndex(min_n, max_n)
        self.max_length = max_length
        self.length = max(1, max_length // 2)
        self._misses = 0  # verified drafts in a row that kept nothing
        self._skip = 0  # steps left without drafting

    def next_length(self) -> int:
        """The draft length to try this step (0 while backing off); each call is one step."""
        if self._skip > 0:
            self._skip -= 1
            return 0
        return self.length

    def observe(self, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens was verified and its first `accepted` kept."""
        if accepted >= drafted:
            self.length = min(self.max_length, 2 * max(self.length, drafted))
        else:
            self.length = max(1, min(self.max_length, accepted + 1))
        if accepted == 0:
            self._misses += 1
            self._skip = min(_MAX_BACKOFF_STEPS, 1 << self._misses) if self._misses >= 2 else 0
        else:
            self._misses = 0


class Drafter:
    """Proposes drafts in mode `ngram` (the request's own tokens) or `suffix` (those, then the session's
    earlier outputs), and keeps the sessions' outputs (`finished`). Engine thread only."""

    def __init__(self, mode: str, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        if mode not in SPECULATIVE_MODES or mode == "off":
            raise ValueError(f"speculative mode must be ngram or suffix, got {mode!r}")
        self.mode, self.num_speculative_tokens = mode, num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n
        self.sessions = SessionOutputs(min_n=min_n, max_n=max_n) if mode == "suffix" else None
        self.stats = SpecStats()

    def new_state(self) -> DraftState:
        return DraftState(self.min_n, self.max_n, self.num_speculative_tokens)

    def propose(
        self, tokens: Sequence[int], state: DraftState, limit: int, salt: str | None, session: Hashable | None
    ) -> tuple[int, ...]:
        """The draft to verify after `tokens` (the request's prompt + output): at most `limit` tokens and the
        state's `next_length()`; () when drafting is backing off or nothing matches."""
        k = min(limit, state.next_length())
        if k <= 0:
            return ()
        draft = state.index.propose(tokens, k)
        if not draft and self.sessions is not None and session is not None:
            draft = self.sessions.propose(salt, session, tokens[-self.max_n :], k)
        return draft

    def verified(self, state: DraftState, drafted: int, accepted: int) -> None:
        """Count one verified draft and adapt the request's next length."""
        self.stats.drafts += 1
        self.stats.draft_tokens += drafted
        self.stats.accepted_tokens += accepted
        state.observe(drafted, accepted)

    def finished(self, salt: str | None, session: Hashable | None, output: Sequence[int]) -> None:
        """A request ended: in mode `suffix`, a session's output is kept for its next turns."""
        if self.sessions is not None and session is not None:
            self.sessions.record(salt, session, output)
