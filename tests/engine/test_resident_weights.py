"""The KV budget takes off the bytes the weights hold resident, whatever their layout. A quantized model's
weights are not parameters: on the CPU the native kernel's tiled layout is their only copy (torch's kernels
keep packed planes beside the buffers), and on CUDA they are buffers. Counting parameters alone took a
135M model's weights as 0.1 MiB, so the budget offered memory the weights already held."""

from __future__ import annotations

import torch

from helexa.model.quant.linear import QuantLinear
from helexa.model.resident import resident_weight_bytes
from tests.support.engines import make_engine


def _distinct_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _quant_layers(model: torch.nn.Module) -> list[QuantLinear]:
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


def test_the_native_kernels_tiled_weights_are_counted(tiny_model_dir) -> None:
    engine = make_engine(tiny_model_dir, quantization="int4")
    model = engine.runner.model
    layers = _quant_layers(model)
    assert layers and all(m.qweight is None and m.cpu_matmul is not None for m in layers)  # weights once
    tiled = [t for m in layers for t in m.cpu_matmul.tiled or ()]
    parameters = [*model.parameters(), *model.buffers()]
    assert engine.budget.weight_bytes == resident_weight_bytes(model) == _distinct_bytes([*parameters, *tiled])
    # the tiled weights come on top of the parameters (norms and the tiny model's dense embedding)
    loaded = _distinct_bytes(parameters)
    assert engine.budget.weight_bytes == loaded + _distinct_bytes(tiled) > loaded


def test_torch_kernels_count_their_packed_planes_beside_the_buffers(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setenv("HELEXA_CPU_QUANT_KERNEL", "torch")
    engine = make_engine(tiny_model_dir, quantization="int4")
    model = engine.runner.model
    layers = _quant_layers(model)
    assert layers and all(m.qweight is not None and m.cpu_matmul is not None for m in layers)
    held = [t for m in layers for t in m.cpu_matmul.held_tensors()]
    loaded = [*model.parameters(), *model.buffers()]
    assert held and resident_weight_bytes(model) == _distinct_bytes([*loaded, *held]) > _distinct_bytes(loaded)
    assert engine.budget.weight_bytes == resident_weight_bytes(model)


def test_a_dense_model_counts_its_parameters_once(tiny_model_dir) -> None:
    engine = make_engine(tiny_model_dir, quantization="none")
    model = engine.runner.model
    assert not _quant_layers(model)
    assert engine.budget.weight_bytes == _distinct_bytes([*model.parameters(), *model.buffers()])
    assert engine.budget.weight_bytes >= sum(p.numel() * p.element_size() for p in model.parameters())
