"""Modules over a `QuantizedWeight`: `QuantLinear` (a linear layer) and `QuantEmbedding` (a token
embedding that can also serve as the tied output head). The canonical tensors are buffers, so they
load, move and report like any weight; `prepare()` builds the device's execution once after loading.
"""

from __future__ import annotations

import torch
from torch import nn

from helexa.kernels.quant_matmul import int4_matmul, int8_matmul
from helexa.model.quant.cpu import CpuQuantMatmul
from helexa.model.quant.weight import QuantizedWeight

__all__ = ["QuantEmbedding", "QuantLinear"]


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W kept quantized: helexa's Triton W8A16/W4A16 kernels on CUDA (float32
    accumulation, x's dtype out), torch's packed CPU kernels elsewhere (`helexa.model.quant.cpu`)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("zeros", weight.zeros)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._cpu: CpuQuantMatmul | None = None

    @property
    def weight_q(self) -> QuantizedWeight:  # the weight, as loaded
        return QuantizedWeight(self.qweight, self.scales, self.zeros)

    @property
    def cpu_matmul(self) -> CpuQuantMatmul | None:  # the prepared CPU execution (None on CUDA or before prepare)
        return self._cpu

    def prepare(self) -> None:
        """Build the execution for the buffers' device (CPU: pack; CUDA: nothing). Call after loading."""
        self._cpu = None if self.qweight.is_cuda else CpuQuantMatmul(self.weight_q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N) in x's dtype."""
        rows = x.reshape(-1, self.in_features)
        if self.qweight.is_cuda:
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
        w = self.weight_q
        return f"in={self.in_features}, out={self.out_features}, {w.kind} group={w.group_size}"


class QuantEmbedding(nn.Module):
    """Token embedding over a quantized (V, E) table: looked-up rows are dequantized exactly (float32
    scales, as stored); `logits(x)` multiplies with the same table as a `QuantLinear` (tied head)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self.head = QuantLinear(weight)  # shares the buffers; named `head.*` in the state dict

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) int64 -> (T, E) in the model dtype."""
        h = self.head
        rows = QuantizedWeight(h.qweight[ids], h.scales[ids], None if h.zeros is None else h.zeros[ids])
        return rows.dequantize(torch.float32).to(self.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (S, E) -> (S, V) float32."""
        return self.head(x).float()
