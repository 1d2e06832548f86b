"""`helexa.model.buffers.KeptBuffers`: one buffer per use, reused, grown when too small, never past the cap."""

from __future__ import annotations

import torch

from helexa.model.buffers import KeptBuffers


def test_a_use_gets_its_kept_buffer_grown_on_demand_and_capped() -> None:
    kept = KeptBuffers()
    a = kept.get("logits", 4, 10, cap=1 << 20)
    assert a.shape == (4, 10) and a.dtype == torch.float32 and a.is_contiguous()
    assert kept.get("logits", 2, 10, cap=1 << 20).data_ptr() == a.data_ptr()  # fewer rows: the same memory
    assert kept.get("logits", 5, 8, cap=1 << 20).data_ptr() == a.data_ptr()  # another shape that fits
    assert kept.get("cdf", 4, 10, cap=1 << 20).data_ptr() != a.data_ptr()  # each use its own
    grown = kept.get("logits", 8, 10, cap=1 << 20)
    assert grown.data_ptr() != a.data_ptr() and kept.get("logits", 1, 10, cap=1 << 20).data_ptr() == grown.data_ptr()
    own = [kept.get("logits", 8, 10, cap=8 * 10 * 4 - 1) for _ in range(2)]  # past the cap: each its own
    assert len({grown.data_ptr(), *(t.data_ptr() for t in own)}) == 3
