"""A request as the engine carries it through admission (`Request`), and once it runs (`Sequence`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helexa.admission import Ticket
from helexa.engine.stream import RequestStream
from helexa.kvcache import BlockTable, CachedBlock
from helexa.model.sampling import SamplingParams
from helexa.model.sampling.grammar import TokenConstraint
from helexa.model.text.detokenizer import IncrementalDetokenizer
from helexa.model.text.stopping import StopChecker


@dataclass(frozen=True)
class Request:
    """What a submitted request carries through admission (a ticket's `payload`) until it runs."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    stream: RequestStream
    cache_salt: str | None = None  # blocks are shared only between requests with the same salt
    session: str | None = None  # the prompt_cache_key whose blocks are retained when it ends
    constraint: TokenConstraint | None = None  # structured output: the grammar its tokens must follow


@dataclass(eq=False)
class Sequence:
    """One request being generated.

    `token_ids` is prompt + output so far; `num_computed` counts the leading tokens whose K/V are in
    the cache (the next step computes from there). It stops at `ticket.max_tokens`, the output limit
    admission sized its reservation for. `prefix_parent` is the prefix-cache entry of its last full
    block offered to the cache (`blocks_offered` of them); `cached_tokens` were found in the cache.
    """

    request_id: str
    prompt_len: int
    token_ids: list[int]
    params: SamplingParams
    ticket: Ticket
    stream: RequestStream
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    table: BlockTable
    generator: torch.Generator | None = None
    num_computed: int = 0
    cache_salt: str | None = None
    session: str | None = None
    prefix_parent: CachedBlock | None = None
    blocks_offered: int = 0
    offering: bool = True  # False after a hash collision: its later blocks are not indexed
    cached_tokens: int = 0
    constraint: TokenConstraint | None = None
    dropped_tokens: int = 0  # computed tokens a preemption dropped; those the cache no longer holds are recomputed

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens known so far."""
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.prompt_len

    @property
    def max_tokens(self) -> int:
        """The output limit admission decided."""
        return self.ticket.max_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def in_prefill(self) -> bool:
        """True while prompt tokens remain to be computed."""
        return self.num_computed < self.prompt_len
