"""Which modules of a `CausalLM` hold quantized weights, and swapping them in.

A model module maps to the checkpoint modules whose weights it holds (`checkpoint_modules`): a fused
projection to its stacked ones (q|k|v, gate|up), the embedding to `model.embed_tokens`, others to
themselves. `--quantization` (`QUANTIZATION_CHOICES`):

- auto: weights quantized in the checkpoint stay quantized; dense ones stay dense.
- none: quantized checkpoint weights are dequantised at load (the float reference).
- int8, int4: as auto, and the decoder's dense linear layers are quantized at load (the embedding
  and output head stay as the checkpoint has them, as in vLLM and gpt-fast).
"""

from __future__ import annotations

import torch
from torch import nn

from helexa.model.quant.linear import QuantEmbedding, QuantLinear
from helexa.model.quant.quantize import int4_group_size, quantize_int4, quantize_int8
from helexa.model.quant.weight import QuantizedWeight
from helexa.model.transformer import CausalLM

__all__ = [
    "QUANTIZATION_CHOICES",
    "checkpoint_modules",
    "decoder_linears",
    "install_quantized",
    "quantize_decoder",
    "quantized_modules",
]

QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")


def checkpoint_modules(model: CausalLM, name: str) -> list[str]:
    """The checkpoint module names whose weights the model module `name` holds, in row order."""
    parent, _, local = name.rpartition(".")
    if local in model.packed_modules:  # a fused projection, dense or quantized
        return [f"{parent}.{part}" for part in model.packed_modules[local]]
    return [name]


def decoder_linears(model: CausalLM) -> list[str]:
    """Names of the decoder layers' linear modules (q|k|v, o, gate|up, down of every layer)."""
    return [n for n, m in model.model.layers.named_modules(prefix="model.layers") if isinstance(m, nn.Linear)]


def quantized_modules(model: CausalLM) -> dict[str, QuantLinear]:
    """Every quantized module of the model by name (a tied head appears once, under the embedding's)."""
    out = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    return {n.removesuffix(".head"): w for n, w in out.items()}


def _replace(model: CausalLM, name: str, module: nn.Module) -> None:
    parent, _, local = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, local, module)


def install_quantized(model: CausalLM, name: str, weight: QuantizedWeight, dtype: torch.dtype) -> None:
    """Put a quantized module with `weight` (its tensors used as given) in place of module `name`,
    keeping that module's bias: `QuantEmbedding` (looking up rows in `dtype`) for the embedding,
    `QuantLinear` otherwise."""
    old = model.get_submodule(name)
    if isinstance(old, nn.Embedding):
        _replace(model, name, QuantEmbedding(weight, dtype))
        return
    if not isinstance(old, nn.Linear) or weight.shape != (old.out_features, old.in_features):
        raise ValueError(f"{name}: cannot hold a {weight.shape} quantized weight ({old})")
    _replace(model, name, QuantLinear(weight, old.bias))


def quantize_decoder(model: CausalLM, method: str) -> list[str]:
    """Quantize the decoder's dense linear layers with `method` ("int8" or "int4") in place; returns the
    names of those left dense (int4 needs K divisible by 32)."""
    skipped = []
    for name in decoder_linears(model):
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear):
            continue
        if method == "int4" and int4_group_size(module.in_features) is None:
            skipped.append(name)
            continue
        with torch.no_grad():
            weight = quantize_int8(module.weight) if method == "int8" else quantize_int4(module.weight)
        install_quantized(model, name, weight, model.dtype)
    return skipped
