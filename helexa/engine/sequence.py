"""A running request as the engine sees it: its tokens, cache position, blocks and output plumbing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from helexa.admission import Ticket
from helexa.engine.stream import RequestStream
from helexa.kvcache import BlockTable
from helexa.model.text.detokenizer import IncrementalDetokenizer
from helexa.model.sampling import SamplingParams
from helexa.model.text.stopping import StopChecker


@dataclass(eq=False)
class Sequence:
    """One request being generated.

    `token_ids` is prompt + output so far; `num_computed` counts the leading tokens whose K/V are
    in the cache (the next step computes from there). `params.max_tokens` is the effective limit
    the admission reservation was sized for.
    """

    request_id: str
    prompt_len: int
    token_ids: list[int]
    params: SamplingParams
    ticket: Ticket
    stream: RequestStream
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    generator: torch.Generator | None = None
    table: BlockTable | None = None
    num_computed: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens known so far."""
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.prompt_len

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
