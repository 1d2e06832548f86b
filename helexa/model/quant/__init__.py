"""Quantized weights: the canonical layouts (`QuantizedWeight`), quantizing dense weights at load
(`quantize_int8`, `quantize_int4`), the modules that run them (`QuantLinear`, `QuantEmbedding`) and
which of a model's modules hold them (`apply`)."""

from helexa.model.quant.linear import QuantEmbedding, QuantLinear
from helexa.model.quant.quantize import quantize_int4, quantize_int8
from helexa.model.quant.weight import QuantizedWeight

__all__ = ["QuantEmbedding", "QuantLinear", "QuantizedWeight", "quantize_int4", "quantize_int8"]
