"""Modules over a `QuantizedWeight`: `QuantLinear` (a linear layer) and `QuantEmbedding` (a token
embedding that can also serve as the tied output head). The canonical tensors are buffers, so they
load, move and report like any weight; `prepare()` builds the device's execution once after loading.
"""

from __future__ import annotations

import torch
from torch import nn

from helexa.model.quant.cpu import CpuQuantMatmul, cpu_kernel
from helexa.model.quant.weight import QuantizedWeight

__all__ = ["QuantEmbedding", "QuantLinear"]


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W kept quantized: helexa's Triton W8A16/W4A16 kernels on CUDA (float32
    accumulation, x's dtype out), the CPU kernels of `helexa.model.quant.cpu` elsewhere.

    Weights once: on the CPU with helexa's native kernel, `prepare()` tiles the weight into the
    kernel's layout and lets go of the canonical buffers (`qweight`, `scales`, `zeros` become None and
    leave the state dict), so the tiled bytes are the weight's only resident copy; `weight_q` and
    `rows` rebuild the canonical layout from them on demand. The module then stays on the CPU."""

    qweight: torch.Tensor | None
    scales: torch.Tensor | None
    zeros: torch.Tensor | None

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kind, self.group_size = weight.layout
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("zeros", weight.zeros)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._cpu: CpuQuantMatmul | None = None

    @property
    def weight_q(self) -> QuantizedWeight:
        """The weight: the buffers as loaded, or, once the native kernel's layout is the only copy,
        rebuilt from it (`CpuQuantMatmul.weight`: the same values)."""
        if self.qweight is None:
            assert self._cpu is not None
            return self._cpu.weight()
        assert self.scales is not None  # loaded with the weight, released with it
        return QuantizedWeight(self.qweight, self.scales, self.zeros)

    def dense_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows `ids` (R,) int64 of `weight_q`, dequantised: (R, K) float32 (an embedding lookup)."""
        if self.qweight is None:
            assert self._cpu is not None
            return self._cpu.dense_rows(ids)
        assert self.scales is not None  # loaded with the weight, released with it
        zeros = None if self.zeros is None else self.zeros[ids]
        return QuantizedWeight(self.qweight[ids], self.scales[ids], zeros).dequantize(torch.float32)

    @property
    def cpu_matmul(self) -> CpuQuantMatmul | None:  # the prepared CPU execution (None on CUDA or before prepare)
        return self._cpu

    def prepare(self) -> None:
        """Build the execution for the buffers' device (CPU: tile or pack; CUDA: nothing). Call after
        loading. With the native CPU kernel the canonical buffers are released (weights once)."""
        if self.qweight is None:
            return  # prepared already: the tiled layout is the only copy
        if self.qweight.is_cuda:
            self._cpu = None
            return
        self._cpu = CpuQuantMatmul(self.weight_q)
        if self._cpu.tiled is not None:
            self.qweight = self.scales = self.zeros = None

    def prepare_from(self, weight: QuantizedWeight) -> bool:
        """Prepare for the CPU from `weight` (CPU tensors of this module's layout) while the module's
        own buffers may still be unloaded (on `meta`): the loader's path, module by module. True when
        helexa's native kernel takes it, its tiled layout now the only copy and the buffers None (they
        leave the state dict); False, with nothing changed, when it does not (load the buffers and call
        `prepare`)."""
        if weight.shape != (self.out_features, self.in_features) or weight.layout != (self.kind, self.group_size):
            raise ValueError(
                f"a {weight.kind}/g{weight.group_size} weight of shape {weight.shape} does not fit {self.extra_repr()}"
            )
        if cpu_kernel(weight) != "native":
            return False
        self._cpu = CpuQuantMatmul(weight, "native")
        self.qweight = self.scales = self.zeros = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N) in x's dtype."""
        rows = x.reshape(-1, self.in_features)
        if self.qweight is not None and self.qweight.is_cuda:
            assert self.scales is not None  # on CUDA the loaded buffers are the weight
            # Imported here: Triton is loaded only where it runs (a CPU process never imports it).
            from helexa.kernels.quant_matmul import int4_matmul, int8_matmul

            if self.zeros is None:
                y = int8_matmul(rows, self.qweight, self.scales)
            else:
                y = int4_matmul(rows, self.qweight, self.scales, self.zeros)
        else:
            if self._cpu is None:
                self.prepare()
            assert self._cpu is not None
            y = self._cpu(rows)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.kind} group={self.group_size}"


class QuantEmbedding(nn.Module):
    """Token embedding over a quantized (V, E) table: looked-up rows are dequantized exactly (float32
    scales, as stored); `logits(x)` multiplies with the same table as a `QuantLinear` (tied head). The
    table is its head's: on the CPU, the native kernel's tiled layout, read row by row."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self.head = QuantLinear(weight)  # shares the buffers; named `head.*` in the state dict

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) int64 -> (T, E) in the model dtype (any shape of ids: its shape + (E,))."""
        return self.head.dense_rows(ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim).to(self.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (S, E) -> (S, V) float32."""
        return self.head(x).float()
