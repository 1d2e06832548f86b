"""The CPU execution of a `QuantizedWeight`: torch's packed weight-only kernels.

`torch.ops.aten._weight_int4pack_mm_for_cpu` (group-wise int4) and `_weight_int8pack_mm` (per-channel
int8) take their fast, vectorised path with bfloat16 activations and scales; float32 activations take
a scalar path ~25x slower (measured on an AVX2 EPYC, 2 threads; docs/quantization.md). So activations
are rounded to bfloat16 on the way in, scales and zeros are rounded to bfloat16 once when packing, and
the kernels accumulate in float32. A group-wise int8 weight (GGUF Q8_0) runs as two int4 planes, high
and low nibble of q + 128: d*q == 16d*(h - 8) + (d*(l - 8) + 8d), exactly.

Those kernels are matrix-vector products per row: for many rows (prefill) a dense float32 matmul is
faster, so beyond `DENSE_ROWS` rows the weight is expanded per call to float32 with the very same
rounded scales and zeros, and the bfloat16-rounded activations are multiplied with it: both paths
compute the same numbers up to float32 summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helexa.kernels.quant_reference import unpack_int4
from helexa.model.quant.weight import QuantizedWeight

__all__ = ["COMPUTE_DTYPE", "DENSE_ROWS", "CpuQuantMatmul"]

COMPUTE_DTYPE = torch.bfloat16
DENSE_ROWS = 64  # rows from which expanding the weight and a dense matmul is faster (bench/test_bench_quant.py)
_INNER_K_TILES = 1  # any value works on CPU; the packed layout is opaque


class _Int4Plane:
    """One packed int4 weight for `_weight_int4pack_mm_for_cpu`: W = (q - 8) * s + z, group G."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        n, k = q.shape
        self.group = k // scales.shape[1]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), _INNER_K_TILES)
        # (K/G, N, 2): scale and zero of group g of row n
        self.scales_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous().to(COMPUTE_DTYPE)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_zeros)


class CpuQuantMatmul:
    """`y = x @ W.T` for one quantized weight on the CPU, prepared once (packing takes a copy)."""

    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight = weight
        self.shape = weight.shape
        scales = weight.scales if weight.scales.dim() == 2 else weight.scales[:, None]
        self._rounded_scales = scales.to(COMPUTE_DTYPE).float()[..., None]  # (N, groups, 1)
        zeros = weight.zeros
        self._rounded_zeros = None if zeros is None else zeros.to(COMPUTE_DTYPE).float()[..., None]
        self._int8: tuple[torch.Tensor, torch.Tensor] | None = None
        self._planes: list[_Int4Plane] = []
        if weight.kind == "int8" and weight.scales.dim() == 1:
            self._int8 = (weight.qweight.contiguous(), weight.scales.to(COMPUTE_DTYPE))
        elif weight.kind == "int8":
            u = weight.qweight.to(torch.int32) + 128  # (N, K) in [0, 255]
            d = weight.scales.float()
            self._planes = [_Int4Plane(u >> 4, 16 * d, torch.zeros_like(d)), _Int4Plane(u & 15, d, 8 * d)]
        else:
            assert weight.zeros is not None
            self._planes = [_Int4Plane(unpack_int4(weight.qweight), weight.scales.float(), weight.zeros.float())]

    def dense(self) -> torch.Tensor:
        """W (N, K) float32 with the bfloat16-rounded scales and zeros the packed kernels use (the same
        values as `QuantizedWeight.dequantize` of those, in a few broadcast passes)."""
        n, k = self.shape
        groups = self._rounded_scales.shape[1]
        if self._rounded_zeros is None:  # int8
            q = self.weight.qweight.view(n, groups, k // groups).float()
            return (q * self._rounded_scales).view(n, k)
        qw = self.weight.qweight
        q = torch.stack((qw & 0xF, qw >> 4), dim=-1).view(n, groups, k // groups).float() - 8
        return torch.addcmul(self._rounded_zeros, q, self._rounded_scales).view(n, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) float -> (M, N) in x's dtype."""
        xc = x.to(COMPUTE_DTYPE)
        if x.shape[0] >= DENSE_ROWS:
            return F.linear(xc.float(), self.dense()).to(x.dtype)
        if self._int8 is not None:
            y = torch.ops.aten._weight_int8pack_mm(xc, *self._int8)
        else:
            y = self._planes[0](xc)
            for plane in self._planes[1:]:
                y = y.float() + plane(xc).float()
        return y.to(x.dtype)
