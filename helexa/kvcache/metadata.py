"""The per-step attention inputs, built once per step and passed down the model unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything `write_kv` and `paged_attention` need for one step of a flattened varlen batch.

    All tensors live on the model's device; the host ints let launches size their grids without a sync.
    """

    slot_mapping: torch.Tensor  # (T,) int64 — pool slot of each new token's K/V; -1 = skip
    block_tables: torch.Tensor  # (B, max_blocks) int32 — padding entries are never read
    seq_lens: torch.Tensor  # (B,) int32 — context length including this step's tokens
    query_start_loc: torch.Tensor  # (B+1,) int32 — prefix sums of per-sequence new-token counts
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
