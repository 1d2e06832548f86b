"""A request as the engine carries it until it runs (`Request`), and once it runs (`Sequence`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from helexa.admission import Ticket
from helexa.engine.speculative.drafter import DraftState
from helexa.engine.stream import RequestStream
from helexa.model.sampling import SamplingParams
from helexa.model.sampling.grammar import TokenConstraint
from helexa.model.text.detokenizer import IncrementalDetokenizer
from helexa.model.text.stopping import StopChecker

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Request:
    """What a submitted request is: its id, prompt, sampling parameters (`params.max_tokens` is the output
    limit it *requested*, None for the node's default), stream and structured-output constraint.

    `cache_salt` and `session` (its prompt_cache_key) are what the KV owner was told at submit: blocks are
    shared only between requests of one salt, and a session's blocks are retained when it ends.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    stream: RequestStream
    cache_salt: str | None = None
    session: str | None = None
    constraint: TokenConstraint | None = None


@dataclass(eq=False)
class Sequence:
    """One request being generated.

    `token_ids` is prompt + output so far (the KV owner's holding reads this same list); `num_computed`
    counts the leading tokens whose K/V are in the cache (the next step computes from there). It stops at
    `granted_max_tokens`, the output limit admission granted and sized its reservation for; `cached_tokens`
    of its prompt were found in the prefix cache. Which blocks it holds is the KV owner's record, by
    `request_id`.
    """

    request: Request
    ticket: Ticket
    token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    generator: torch.Generator | None = None
    num_computed: int = 0
    cached_tokens: int = 0
    dropped_tokens: int = 0  # computed tokens a preemption dropped; those the cache no longer holds are recomputed
    draft_state: DraftState | None = None  # speculative decoding: its prompt-lookup index and draft length
    loading: bool = False  # its next full blocks may be in a tier below the pool: loaded (a chunk a step) first
    # The request's own, copied once (it is frozen): every step reads these for every sequence, several times.
    request_id: str = field(init=False)
    params: SamplingParams = field(init=False)
    stream: RequestStream = field(init=False)
    constraint: TokenConstraint | None = field(init=False)
    prompt_len: int = field(init=False)
    _prompt_array: np.ndarray | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        request = self.request
        self.request_id, self.params, self.stream = request.request_id, request.params, request.stream
        self.constraint, self.prompt_len = request.constraint, len(request.prompt)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens known so far."""
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.prompt_len

    @property
    def granted_max_tokens(self) -> int:
        """The output limit admission granted (the request's own, or the node's default when it gave none)."""
        return self.ticket.max_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def prompt_array(self) -> np.ndarray:
        """The prompt's ids as a read-only int64 array, built at the first call and kept (the sampler's
        repetition penalty reads a row's whole prompt every step)."""
        if self._prompt_array is None:
            array = np.asarray(self.request.prompt, dtype=np.int64)
            array.flags.writeable = False
            self._prompt_array = array
        return self._prompt_array

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def in_prefill(self) -> bool:
        """True while prompt tokens remain to be computed."""
        return self.num_computed < self.prompt_len
