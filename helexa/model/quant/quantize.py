"""Weight-only quantization of dense weights at load (`--quantization int8 | int4`).

int8: symmetric per output channel (scale = max|w| / 127), as torch's and vLLM's weight-only int8.
int4: asymmetric per group of G input features along K (scale = (max - min) / 15, zero so that q = 0
maps to the group's minimum), as gpt-fast and torchao's int4 weight-only; G is the largest of 128, 64
and 32 that divides K. Rounding is to nearest; values are computed in float32.
"""

from __future__ import annotations

import torch

from helexa.kernels.quant_reference import pack_int4
from helexa.model.quant.weight import QuantizedWeight

__all__ = ["INT4_GROUP_SIZES", "int4_group_size", "quantize_int4", "quantize_int8"]

INT4_GROUP_SIZES = (128, 64, 32)


def int4_group_size(k: int) -> int | None:
    """The group size `quantize_int4` uses for K input features, or None when no supported size divides K."""
    return next((g for g in INT4_GROUP_SIZES if k % g == 0), None)


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """w (N, K) float -> int8 per-channel weight; |W - w| <= scale / 2 elementwise."""
    w = w.float()
    scales = w.abs().amax(dim=1) / 127  # (N,)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)  # (N, K)
    return QuantizedWeight.of(q, scales)


def quantize_int4(w: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """w (N, K) float -> int4 group-wise weight; |W - w| <= scale / 2 elementwise. `ValueError` when
    `group_size` (default `int4_group_size(K)`) does not divide K."""
    n, k = w.shape
    group = group_size or int4_group_size(k)
    if group is None or k % group or group % 2:
        raise ValueError(f"int4 needs a group size dividing K = {k} (one of {INT4_GROUP_SIZES}), got {group}")
    g = w.float().reshape(n, k // group, group)  # (N, K/G, G)
    low, high = g.amin(dim=-1), g.amax(dim=-1)  # (N, K/G)
    scales = (high - low) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((g - low[..., None]) / scales[..., None]).clamp_(0, 15).reshape(n, k)
    return QuantizedWeight.of(pack_int4(q.to(torch.uint8)), scales, low + 8 * scales)
