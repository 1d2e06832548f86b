"""What each decoding sequence proposes to verify this step, and how long a draft it tries.

`Drafter.propose(tokens, state, limit, ...)` reads the request's own tokens (prompt lookup,
`NgramIndex`) and, in mode `suffix`, its session's earlier outputs (`SessionOutputs`). Each request's
`DraftState` chooses the draft's length from what its own drafts recently kept and from what a verified
row costs now (what draft rows added to the recent steps that verified some, `StepEstimate.row_seconds`;
at long context a row attends over the whole context), while a kept token saves
this request a step, whose time its batch's decodes share. So a copying request at one stream drafts
long, a request whose drafts keep little drafts short, and where not even one token pays (text that
does not copy, or a batch large enough that rows are dear) it pauses, probing again now and then:
speculation then costs next to nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from helexa.engine.speculative.ngram import NgramIndex, compiled_tables
from helexa.engine.speculative.sessions import SessionOutputs

__all__ = ["DraftState", "Drafter", "SpecStats", "SPECULATIVE_MODES"]

SPECULATIVE_MODES = ("off", "ngram", "suffix")
_PRIOR_KEPT, _PRIOR_CUT = 1.5, 1.0  # the acceptance estimate before any draft: 0.6
_DECAY = 0.5  # per verified draft: the last few drafts decide
_MIN_GAIN = 0.10  # a draft must promise 10% more tokens per unit of time than decoding alone: the row cost is
# a recent median, and a draft has fixed costs of its own (lookup, bookkeeping)
_MAX_PAUSE_STEPS = 64
_DEFAULT_ROW_COST = 0.05  # before the engine has measured its steps


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
    """One request's drafting: its prompt-lookup index and what its drafts have kept, from which
    `next_length(row_cost)` picks the draft length that pays best now (see the module docstring)."""

    __slots__ = ("index", "max_length", "_kept", "_cut", "_skip", "_wait")

    def __init__(self, min_n: int, max_n: int, max_length: int) -> None:
        self.index = NgramIndex(min_n, max_n)
        self.max_length = max_length
        # Decayed counts of draft tokens kept and of drafts cut short: a Beta-like estimate of the chance
        # that the next draft token is kept, starting at 0.6 (a draft is tried before anything is known).
        self._kept, self._cut = _PRIOR_KEPT, _PRIOR_CUT
        self._skip = 0  # steps left without drafting
        self._wait = 1  # the next pause, doubled each time drafting does not pay (at most 64 steps)

    @property
    def acceptance(self) -> float:
        """The estimated chance that the request's next draft token is kept."""
        return self._kept / (self._kept + self._cut)

    def next_length(self, row_cost: float = _DEFAULT_ROW_COST) -> int:
        """The draft length to try this step (0: skip). `row_cost`: what one more verified row costs, as a
        fraction of what one more token of this request is worth (a step's time shared by its decodes).
        With acceptance a, a draft of k tokens keeps a(1 - a^k)/(1 - a) on average for a cost of k rows;
        the length maximising (1 + kept) / (1 + row_cost k) is chosen. Where even one token does not pay,
        the request pauses (2, 4, ... 64 steps), then tries one token again."""
        if self._skip > 0:
            self._skip -= 1
            return 0
        a = self.acceptance
        best, best_gain, kept, power = 0, 1.0 + _MIN_GAIN, 0.0, 1.0
        for k in range(1, self.max_length + 1):
            power *= a
            kept += power  # a + a^2 + ... + a^k: the expected tokens kept of a k-token draft
            gain = (1.0 + kept) / (1.0 + row_cost * k)
            if gain > best_gain:
                best, best_gain = k, gain
        if best == 0:
            self._skip, self._wait = self._wait, min(_MAX_PAUSE_STEPS, 2 * self._wait)
            return 1  # a probe: without one the estimate would never learn that drafts pay again
        return best

    def observe(self, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens was verified and its first `accepted` kept."""
        self._kept = _DECAY * self._kept + accepted
        self._cut = _DECAY * self._cut + (1 if accepted < drafted else 0)
        if accepted:  # drafts pay again: no pause
            self._skip, self._wait = 0, 1


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
        compiled_tables()  # the prompt-lookup tables built or loaded now, not in a request's first step

    def new_state(self) -> DraftState:
        return DraftState(self.min_n, self.max_n, self.num_speculative_tokens)

    def propose(
        self,
        tokens: Sequence[int],
        state: DraftState,
        limit: int,
        salt: str | None,
        session: Hashable | None,
        row_cost: float = _DEFAULT_ROW_COST,
    ) -> tuple[int, ...]:
        """The draft to verify after `tokens` (the request's prompt + output): at most `limit` tokens and the
        state's `next_length(row_cost)`; () when drafting does not pay now or nothing matches."""
        if limit <= 0:
            return ()
        k = min(limit, state.next_length(row_cost))
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
