"""`QuantizedWeight`: one linear layer's weight kept quantized, in the canonical layouts of
`helexa.kernels.quant_matmul` (the same numbers on every device):

- int8: `qweight` int8 (N, K); `scales` (N,) per channel or (N, K // G) per group; W = q * s.
- int4: `qweight` uint8 (N, K // 2), even k in the low nibble; `scales` and `zeros` (N, K // G);
  W = (q - 8) * s + z.

Rows are output features, so fused projections (q|k|v, gate|up) concatenate by rows and row
permutations (llama.cpp's q/k order) permute all three tensors alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helexa.kernels.quant_reference import dequantize_int4, dequantize_int8

__all__ = ["QuantizedWeight", "SUFFIXES"]

# Checkpoint tensors of a quantized module `X`: `X.qweight`, `X.scales` and (int4) `X.zeros`.
SUFFIXES = ("qweight", "scales", "zeros")


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized (N, K) weight. Build it with `of`, which checks the layout."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None  # int4 only

    @staticmethod
    def of(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None) -> QuantizedWeight:
        """The weight for these tensors; `ValueError` naming what is wrong when they do not form one of
        the two layouts (dtypes, shapes, a group size that does not divide K)."""
        if qweight.dim() != 2:
            raise ValueError(f"qweight must be 2-D, got {tuple(qweight.shape)}")
        if not scales.is_floating_point() or (zeros is not None and not zeros.is_floating_point()):
            raise ValueError(f"scales and zeros must be floating point, got {scales.dtype}")
        n = qweight.shape[0]
        if qweight.dtype == torch.int8:
            if zeros is not None:
                raise ValueError("int8 weights carry no zeros (symmetric: W = q * s)")
            k = qweight.shape[1]
            if scales.shape != (n,) and (scales.dim() != 2 or scales.shape[0] != n):
                raise ValueError(f"int8 scales must be ({n},) or ({n}, K/G), got {tuple(scales.shape)}")
        elif qweight.dtype == torch.uint8:
            if zeros is None or zeros.shape != scales.shape or scales.dim() != 2 or scales.shape[0] != n:
                raise ValueError(
                    f"int4 needs scales and zeros of one shape ({n}, K/G), got {tuple(scales.shape)} and "
                    f"{None if zeros is None else tuple(zeros.shape)}"
                )
            k = 2 * qweight.shape[1]
        else:
            raise ValueError(f"qweight must be int8 (int8 layout) or uint8 (packed int4), got {qweight.dtype}")
        if scales.dim() == 2 and (scales.shape[1] == 0 or k % scales.shape[1]):
            raise ValueError(f"{scales.shape[1]} groups per row do not divide K = {k}")
        return QuantizedWeight(qweight, scales, zeros)

    @property
    def kind(self) -> str:  # "int8" or "int4"
        return "int8" if self.qweight.dtype == torch.int8 else "int4"

    @property
    def shape(self) -> tuple[int, int]:  # (N, K) of the weight it stands for
        n, cols = self.qweight.shape
        return n, cols if self.kind == "int8" else 2 * cols

    @property
    def group_size(self) -> int:  # K for per-channel scales
        return self.shape[1] if self.scales.dim() == 1 else self.shape[1] // self.scales.shape[1]

    @property
    def layout(self) -> tuple[str, int]:  # what must match for two weights to be concatenated
        return self.kind, self.group_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.qweight, self.scales) if self.zeros is None else (self.qweight, self.scales, self.zeros)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W (N, K) in `dtype`, computed in float32 (the exact values of the layout's formula)."""
        if self.zeros is None:
            return dequantize_int8(self.qweight, self.scales.float()).to(dtype)
        return dequantize_int4(self.qweight, self.scales.float(), self.zeros.float()).to(dtype)

    def to(self, device: torch.device | str, scale_dtype: torch.dtype | None = None) -> QuantizedWeight:
        """The same weight on `device`, scales and zeros in `scale_dtype` (kept when None)."""
        s_dtype = scale_dtype or self.scales.dtype
        zeros = None if self.zeros is None else self.zeros.to(device, s_dtype)
        return QuantizedWeight(self.qweight.to(device), self.scales.to(device, s_dtype), zeros)
