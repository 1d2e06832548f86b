"""The admission controller's configuration: pool geometry, the two gates, the queue and its deadline."""

from __future__ import annotations

import math
from dataclasses import dataclass

POLICIES = ("fifo", "backfill")

# Reservations are exact, so a request that omits `max_tokens` reserves room for this many output
# tokens (capped by `max_model_len - prompt_tokens`). Long agentic turns should send `max_tokens`.
DEFAULT_MAX_TOKENS = 4096
# Long enough for a 70–150 s agentic turn to wait behind two or three others of the same size.
DEFAULT_MAX_WAIT_SECS = 600.0
# How stale a wait estimate may get while only progress (not a grant, release or cancel) changed.
DEFAULT_REPLAN_INTERVAL_SECS = 0.25


@dataclass(frozen=True)
class AdmissionConfig:
    """Everything the controller decides with that is fixed while a model is loaded.

    - `block_size`, `num_blocks`: the KV pool's geometry (`BlockPool.block_size`, `.num_blocks`).
    - `max_model_len`: longest sequence (prompt + output) accepted.
    - `max_num_seqs`: the request-count gate — most sequences holding a reservation at once.
    - `max_queue_depth`: most requests waiting for admission (0: nothing waits).
    - `max_wait_secs`: longest a request may wait in the queue (default 600 s).
    - `default_max_tokens`: output tokens reserved when a request gives none (default 4096).
    - `policy`: `"fifo"` (the head blocks everything behind it) or `"backfill"` (a request behind the
      head may start now if its estimated finish is no later than the head's estimated start).
    - `replan_interval_secs`: the wait estimates are re-simulated at once after a grant, release or
      cancel, and at most this often when only decode progress or measured rates changed (0: always).
    """

    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int = 256
    max_queue_depth: int = 1024
    max_wait_secs: float = DEFAULT_MAX_WAIT_SECS
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    policy: str = "fifo"
    replan_interval_secs: float = DEFAULT_REPLAN_INTERVAL_SECS

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_model_len", "max_num_seqs", "default_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AdmissionConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.max_queue_depth, int) or self.max_queue_depth < 0:
            raise ValueError(f"AdmissionConfig.max_queue_depth must be an int >= 0, got {self.max_queue_depth!r}")
        if not (self.max_wait_secs > 0 and math.isfinite(self.max_wait_secs)):
            raise ValueError(f"AdmissionConfig.max_wait_secs must be a finite number > 0, got {self.max_wait_secs!r}")
        if not (self.replan_interval_secs >= 0 and math.isfinite(self.replan_interval_secs)):
            raise ValueError(
                f"AdmissionConfig.replan_interval_secs must be a finite number >= 0, got {self.replan_interval_secs!r}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"AdmissionConfig.policy must be one of {POLICIES}, got {self.policy!r}")

    @property
    def blocks_total(self) -> int:
        """Blocks in the whole pool (the name `/v1/admission` uses)."""
        return self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: `ceil(num_tokens / block_size)`."""
        return -(-num_tokens // self.block_size)
