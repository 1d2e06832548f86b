"""The per-step attention inputs, built once per step and passed down the model unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything `write_kv` and `paged_attention` need for one step of a flattened varlen batch.

    All tensors live on the model's device. Host ints (`max_query_len`, `max_seq_len`) are carried
    so kernel launches need no device synchronisation to size their grids.
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

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "AttentionMetadata":
        """A copy on `device` (one transfer per tensor, non-blocking where the source is pinned)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping.to(device, non_blocking=non_blocking),
            block_tables=self.block_tables.to(device, non_blocking=non_blocking),
            seq_lens=self.seq_lens.to(device, non_blocking=non_blocking),
            query_start_loc=self.query_start_loc.to(device, non_blocking=non_blocking),
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
        )
