"""The token bitmask a step's constrained rows are sampled under: `allocate_bitmask` (one row per sampled row,
every token allowed until a `TokenConstraint` fills its row) and `masked_logits` (the forbidden tokens set to
-inf on the logits' device)."""

from __future__ import annotations

import torch

__all__ = ["allocate_bitmask", "masked_logits"]


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask of `rows` rows for `vocab_size` tokens (32 tokens per word), every token allowed."""
    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` (S, V) with the tokens `bitmask` forbids set to -inf, as a new tensor (the input is not
    changed). `bitmask`: (S, W) int32 on the host, W >= ceil(V / 32), one row per logits row, every bit set
    in a row without a constraint (`allocate_bitmask`); such rows are copied unchanged. One host-to-device
    copy of the constrained rows' words; the bits are unpacked on the logits' device."""
    vocab = logits.shape[1]
    words = bitmask[:, : -(-vocab // 32)]  # (S, ceil(V / 32))
    rows = (words != -1).any(dim=1).nonzero().flatten().tolist()  # host tensor: no device sync
    if not rows:
        return logits
    index = torch.tensor(rows, device=logits.device)  # (R,)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # (32,)
    row_words = words[rows].to(logits.device, non_blocking=True)  # (R, ceil(V / 32))
    allowed = ((row_words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]  # (R, V)
    masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))  # (R, V)
    return logits.index_copy(0, index, masked)
