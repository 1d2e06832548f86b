"""The token bitmask a step's constrained rows are sampled under: `allocate_bitmask` (one row per sampled row,
every token allowed until a `TokenConstraint` fills its row) and `masked_logits` (the forbidden tokens set to
-inf on the logits' device)."""

from __future__ import annotations

import functools
import sys

import torch

__all__ = ["allocate_bitmask", "masked_logits"]


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask of `rows` rows for `vocab_size` tokens (32 tokens per word), every token allowed."""
    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`logits` (S, V) with the tokens `bitmask` forbids set to -inf: written into `out` ((S, V), not the
    logits' memory) when given, else a new tensor (the input is not changed; with no constrained row, the
    input itself). `bitmask`: (S, W) int32 on the host, W >= ceil(V / 32), bit j of word w for token 32 w + j,
    one row per logits row, every bit set in a row without a constraint (`allocate_bitmask`); such rows are
    copied unchanged. One host-to-device copy of the constrained rows' words; each byte of them becomes its
    8 tokens' flags through a 256-entry table on the logits' device (no (S, V) int32 expansion)."""
    vocab = logits.shape[1]
    words = bitmask[:, : -(-vocab // 32)]  # (S, ceil(V / 32))
    rows = (words != -1).any(dim=1).nonzero().flatten().tolist()  # host tensor: no device sync
    if not rows:
        return logits
    device = logits.device
    out = logits.clone() if out is None else out.copy_(logits)
    row_bytes = words[rows].contiguous().view(torch.uint8).view(len(rows), -1, 4)  # (R, W, 4): each word's bytes
    if sys.byteorder == "big":  # the words' low byte first, as bit j of a word is token 32 w + j
        row_bytes = row_bytes.flip(-1)
    row_bytes = row_bytes.to(device, non_blocking=True).flatten(1).long()  # (R, 4W)
    allowed = _byte_bits(device)[row_bytes].flatten(1)[:, :vocab]  # (R, V) bool
    if len(rows) == logits.shape[0]:
        return out.masked_fill_(~allowed, float("-inf"))
    index = torch.tensor(rows, device=device)  # (R,)
    return out.index_copy_(0, index, out.index_select(0, index).masked_fill_(~allowed, float("-inf")))


@functools.cache
def _byte_bits(device: torch.device) -> torch.Tensor:
    """(256, 8) bool: bit k of each byte value, on `device` (made once per device)."""
    values = torch.arange(256, dtype=torch.int32)
    return ((values[:, None] >> torch.arange(8, dtype=torch.int32)) & 1).bool().to(device)
