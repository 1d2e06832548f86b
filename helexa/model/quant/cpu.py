"""The CPU execution of a `QuantizedWeight`, in one of two kernels chosen once per process.

- `native` (the default where it builds: x86-64 with AVX2 and FMA, a C compiler): helexa's own
  kernel (`helexa.model.quant.native`). Activations go through an int8 round trip per 32-value
  block (`quantize_activations`, llama.cpp's scheme), products are integer dot products, and a batch
  of rows shares one pass over the weight. Result: `quantize_activations(x) @ W.T` with W the exact
  dequantised weight, up to float32 summation order.
- `torch`: torch's packed weight-only kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`),
  whose fast path takes bfloat16 activations and scales (float32 takes a scalar path ~25x slower).
  Activations are rounded to bfloat16, scales and zeros to bfloat16 once when packing, and the
  kernels accumulate in float32. Group-wise int8 (GGUF Q8_0) runs as two int4 planes, high and low
  nibble of q + 128: d*q == 16d*(h - 8) + (d*(l - 8) + 8d), exactly. These kernels are
  matrix-vector products per row.

helexa's kernel serves every row count: on an AVX2 EPYC it matched a dense float32 matmul of the
already-dequantised weight from 64 to 512 rows and beat expanding the weight first (bench/RESULTS.md),
and since it computes each row the same way whatever the batch, a row's result never depends on
the step it ran in. torch's kernels are matrix-vector products per row: from `DENSE_ROWS` rows on
(prefill), that path instead expands the weight per call to float32 and multiplies densely, with the
same bfloat16 activations and scales, so both of its paths agree up to float32 summation order.
`HELEXA_CPU_QUANT_KERNEL=torch` forces torch's kernels (for comparisons); the default `auto` takes
`native` when it is available.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from helexa.kernels.quant_reference import unpack_int4
from helexa.model.quant import native
from helexa.model.quant.weight import QuantizedWeight

__all__ = ["COMPUTE_DTYPE", "DENSE_ROWS", "CpuQuantMatmul", "cpu_kernel"]

COMPUTE_DTYPE = torch.bfloat16  # the torch kernels' activation and scale dtype
DENSE_ROWS = 64  # torch kernels: rows from which expanding the weight for a dense matmul is faster
_INNER_K_TILES = 1  # any value works on CPU; the packed layout is opaque


def cpu_kernel(weight: QuantizedWeight | None = None) -> str:
    """ "native" or "torch": the kernel this process uses (for `weight`, when given: the native kernel
    needs K and the group size to be multiples of 32)."""
    if os.environ.get("HELEXA_CPU_QUANT_KERNEL", "auto") == "torch" or not native.available():
        return "torch"
    if weight is not None and not native.supports(*weight.shape, weight.group_size):
        return "torch"
    return "native"


class _Int4Plane:
    """One packed int4 weight for `_weight_int4pack_mm_for_cpu`: W = (q - 8) * s + z, group G."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        self.group = q.shape[1] // scales.shape[1]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), _INNER_K_TILES)
        # (K/G, N, 2): scale and zero of group g of row n
        self.scales_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous().to(COMPUTE_DTYPE)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_zeros)


class CpuQuantMatmul:
    """`y = x @ W.T` for one quantized weight on the CPU, prepared once. The native kernel's tiled
    layout (`tiled`) is the only copy it keeps: nothing here refers to the weight it was given, so
    once its owner lets go of that weight the tiled bytes are the weight's one resident copy
    (`weight()` rebuilds the canonical layout on demand). torch's kernels pack a copy of their own."""

    def __init__(self, weight: QuantizedWeight, kernel: str | None = None) -> None:
        self.shape = weight.shape
        self.kernel = kernel or cpu_kernel(weight)
        if self.kernel not in ("native", "torch"):
            raise ValueError(f"unknown CPU quant kernel {self.kernel!r}; expected 'native' or 'torch'")
        self.tiled: tuple[torch.Tensor, ...] | None = None  # the native kernel's layout (`native.tile_*`)
        self._held: tuple[torch.Tensor, ...] = ()  # torch's kernels: every tensor they keep (`held_tensors`)
        if self.kernel == "native":
            self._run = self._native_run(weight)
            return
        scales = weight.scales if weight.scales.dim() == 2 else weight.scales[:, None]  # (N, groups)
        # torch's kernels compute with bfloat16 scales and zeros: those values, as float32 (N, groups)
        zeros = None if weight.zeros is None else weight.zeros.to(COMPUTE_DTYPE).float()
        self._weight = QuantizedWeight(weight.qweight, scales.to(COMPUTE_DTYPE).float().contiguous(), zeros)
        self._run = self._torch_run(weight)

    def held_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor this kernel keeps resident: the native tiled layout, or torch's packed planes and
        the weight it computes with (some may share storage with the weight it was given)."""
        return self.tiled if self.tiled is not None else self._held

    def weight(self, rows: torch.Tensor | None = None) -> QuantizedWeight:
        """The weight this kernel computes with, in the canonical layout (native: rebuilt from the
        tiled bytes, `native.untile`; torch: with its bfloat16-rounded scales and zeros), or only its
        rows `rows` (R,) int64."""
        if self.tiled is not None:
            return native.untile(self.tiled, rows)
        w = self._weight
        if rows is None:
            return w
        return QuantizedWeight(w.qweight[rows], w.scales[rows], None if w.zeros is None else w.zeros[rows])

    def dense_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """`weight(rows).dequantize(torch.float32)`: the rows (R,) int64 of W the kernel computes with,
        (R, K) float32 (an embedding lookup; native: one call over the tiled bytes)."""
        if self.tiled is not None:
            return native.dequantize_rows(self.tiled, rows)
        return self.weight(rows).dequantize(torch.float32)

    def _native_run(self, w: QuantizedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
        scales = (w.scales if w.scales.dim() == 2 else w.scales[:, None]).float()  # (N, groups)
        if w.zeros is None:
            tiled = self.tiled = native.tile_int8(w.qweight, scales)
            return lambda x: native.int8_gemm(x, tiled)
        tiled = self.tiled = native.tile_int4(w.qweight, scales, w.zeros.float())
        return lambda x: native.int4_gemm(x, tiled)

    def _torch_run(self, w: QuantizedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
        if w.kind == "int8" and w.scales.dim() == 1:
            int8 = (w.qweight.contiguous(), w.scales.to(COMPUTE_DTYPE))
            self._held = (*self._weight.tensors(), *int8)
            return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(COMPUTE_DTYPE), *int8).float()
        if w.kind == "int8":
            u = w.qweight.to(torch.int32) + 128  # (N, K) in [0, 255]
            d = w.scales.float()
            planes = [_Int4Plane(u >> 4, 16 * d, torch.zeros_like(d)), _Int4Plane(u & 15, d, 8 * d)]
        else:
            assert w.zeros is not None
            planes = [_Int4Plane(unpack_int4(w.qweight), w.scales.float(), w.zeros.float())]
        self._held = (*self._weight.tensors(), *(t for plane in planes for t in (plane.packed, plane.scales_zeros)))

        def run(x: torch.Tensor) -> torch.Tensor:
            xc = x.to(COMPUTE_DTYPE)
            y = planes[0](xc).float()
            for plane in planes[1:]:
                y = y + plane(xc).float()
            return y

        return run

    def rounded_activations(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) as the kernel sees it, in float32: the int8 round trip (native) or bfloat16 (torch)."""
        if self.kernel == "native":
            return native.quantize_activations(x.float())
        return x.to(COMPUTE_DTYPE).float()

    def dense(self) -> torch.Tensor:
        """W (N, K) float32 with the scales and zeros the kernel uses (`weight().dequantize()`)."""
        return self.weight().dequantize(torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) float -> (M, N) in x's dtype."""
        if self.kernel == "torch" and x.shape[0] >= DENSE_ROWS:
            return F.linear(self.rounded_activations(x), self.dense()).to(x.dtype)
        return self._run(x.float().contiguous()).to(x.dtype)
