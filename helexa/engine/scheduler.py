"""Which tokens run in the next step: decode tokens first, then prefill chunks, under a token budget."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Schedulable(Protocol):
    """What the scheduler needs to know about a running sequence."""

    @property
    def num_tokens(self) -> int: ...  # prompt + output tokens known so far

    @property
    def num_computed(self) -> int: ...  # tokens whose K/V are in the cache


S = TypeVar("S", bound=Schedulable)


@dataclass(slots=True)  # built per sequence per step: not frozen (a frozen __init__ costs ~3x)
class ScheduledChunk(Generic[S]):
    """`num_new` tokens of `seq` (from position `seq.num_computed`) run this step; `samples` says
    whether the step ends at the sequence's last known token and so samples its next one. A decode
    with a `draft` runs its last known token and then the draft's tokens (`num_new = 1 + len(draft)`),
    and samples after each of them: the draft is verified."""

    seq: S
    num_new: int
    samples: bool
    draft: tuple[int, ...] = ()


def schedule(
    running: Sequence[S],
    max_num_batched_tokens: int,
    prefill_limit: Callable[[int], int] | None = None,
    drafts: Mapping[S, tuple[int, ...]] | None = None,
) -> list[ScheduledChunk[S]]:
    """Pick this step's work under `max_num_batched_tokens`.

    Guarantees: every sequence that only needs its next token (a decode) is scheduled before any
    prefill, so running decodes keep flowing while a long prompt is split across steps (chunked
    prefill); prefills are served in `running` order (admission order), each taking as much of the
    remaining budget as it needs; the total of `num_new` never exceeds the budget; a sequence
    appears at most once; sequences with nothing to compute are skipped.

    `prefill_limit(num_decodes)`, when given, caps the prompt tokens of the step once its decodes are
    chosen (the `StepBudget` sizing prefill chunks to a step time); it never takes budget from a decode.

    `drafts` (speculative decoding): a decoding sequence's draft tokens to verify this step. They take
    what budget the decodes leave, in `running` order, a draft cut short (never below nothing) where
    the budget runs out; a decode never loses its own token to another's draft.
    """
    budget = max_num_batched_tokens
    chunks: list[ScheduledChunk[S]] = []
    prefills: list[S] = []
    for seq in running:
        pending = seq.num_tokens - seq.num_computed
        if pending == 1 and budget > 0:
            chunks.append(ScheduledChunk(seq, 1, True))
            budget -= 1
        elif pending > 1:
            prefills.append(seq)
    if drafts:
        for i, chunk in enumerate(chunks):
            draft = drafts.get(chunk.seq, ())[: max(0, budget)]
            if draft:
                chunks[i] = ScheduledChunk(chunk.seq, 1 + len(draft), True, tuple(draft))
                budget -= len(draft)
    if prefills and prefill_limit is not None:
        budget = min(budget, prefill_limit(len(chunks)))
    for seq in prefills:
        if budget <= 0:
            break
        pending = seq.num_tokens - seq.num_computed
        take = min(pending, budget)
        chunks.append(ScheduledChunk(seq, take, take == pending))
        budget -= take
    return chunks
