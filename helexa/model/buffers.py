"""Working buffers a hot path keeps from one call to the next (`KeptBuffers`).

`helexa.heap.return_large_blocks` has glibc map every block of `LARGE_BLOCK_BYTES` (2 MiB) or more afresh and
unmap it at free, so a freed step gives its memory back. The price is that such a block's pages fault in as
they are first written, every time: ~2.5 us a 4 KiB page on the 2-vCPU VMs measured, 0.8 ms a step for the
3 MiB of logits of 16 rows of a 49k vocabulary, and as much again for each of the sampler's vocabulary-wide
rows. A path that needs the same large buffers every step keeps them here instead: one per use, grown when a
call needs more, up to the cap the caller states (past it, a call gets a tensor of its own). A kept buffer
holds its largest call's bytes for as long as its owner lives.
"""

from __future__ import annotations

import torch

__all__ = ["KeptBuffers"]


class KeptBuffers:
    """One kept float32 buffer per use (a name the owner picks) and device. Not thread-safe: one owner's
    thread uses it."""

    def __init__(self) -> None:
        self._kept: dict[str, torch.Tensor] = {}  # flat buffers by use

    def get(self, use: str, rows: int, cols: int, cap: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """An uninitialised contiguous (rows, cols) float32 tensor on `device` for `use`: the start of the buffer
        kept for it (replaced by a large enough one first), or, when rows x cols x 4 bytes would pass `cap`, a
        tensor of its own. Its contents are whatever the last call left; the caller is done with it by the next
        `get` of the same use."""
        n = rows * cols
        if n * 4 > cap:
            return torch.empty(rows, cols, device=device)
        buf = self._kept.get(use)
        if buf is None or buf.numel() < n or buf.device != torch.device(device):
            buf = self._kept[use] = torch.empty(n, device=device)
        return buf[:n].view(rows, cols)
