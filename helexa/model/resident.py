"""The bytes a loaded model's weights hold resident, whatever their layout: the one count the KV budget
takes off the memory it divides."""

from __future__ import annotations

import torch
from torch import nn

from helexa.model.quant.linear import QuantLinear

__all__ = ["resident_weight_bytes"]


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct storage `model`'s weights occupy: its parameters, its buffers, and what its
    quantized layers' CPU kernels keep (the native kernel's tiled layout, which is then a weight's only
    copy; torch's packed planes). A storage several tensors share (a tied head, views) counts once, whole;
    tensors on `meta` count nothing."""
    storages: dict[tuple[str, int], int] = {}

    def add(tensor: torch.Tensor) -> None:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()

    for tensor in (*model.parameters(), *model.buffers()):
        add(tensor)
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.cpu_matmul is not None:
            for tensor in module.cpu_matmul.held_tensors():
                add(tensor)
    return sum(storages.values())
