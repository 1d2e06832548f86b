"""GGUF Q4_0, Q4_1 and Q8_0 tensors read block by block into helexa's canonical quantized layouts
(`helexa.model.quant.QuantizedWeight`), without dequantising, so a model runs on its file's numbers:

- Q4_0 (per 32: fp16 d, 4-bit q; w = d * (q - 8))  -> int4, group 32: scale d, zero 0.
- Q4_1 (per 32: fp16 d and m, 4-bit q; w = d * q + m) -> int4, group 32: scale d, zero m + 8d.
- Q8_0 (per 32: fp16 d, int8 q; w = d * q)            -> int8, group 32: scale d.

Scales and zeros are float32 (d and m exactly; m + 8d rounded once to float32). In a block, 4-bit
values 0-15 sit in the low nibbles of its 16 bytes and 16-31 in the high ones; helexa packs element
pairs (2j, 2j + 1) into byte j instead, so the nibbles are re-paired here.
"""

from __future__ import annotations

import numpy as np

__all__ = ["KEPT_QUANTIZED", "read_quantized"]

KEPT_QUANTIZED: frozenset[str] = frozenset({"Q4_0", "Q4_1", "Q8_0"})
_BLOCK = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte offset `at` of every block, as float32 (exact)."""
    return blocks[:, at : at + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def read_quantized(data: np.ndarray, kind: str, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """The canonical tensors {"qweight", "scales"[, "zeros"]} of a GGUF tensor of type `kind` (one of
    `KEPT_QUANTIZED`) whose raw bytes are `data` and whose weight is `shape` = (N, K) (rows = output
    features). `ValueError` when the byte count does not match the shape."""
    n, k = shape
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"{kind} is not kept quantized; supported: {sorted(KEPT_QUANTIZED)}")
    if k % _BLOCK:
        raise ValueError(f"{kind} rows of {k} values are not whole blocks of {_BLOCK}")
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    if raw.size != n * (k // _BLOCK) * _BLOCK_BYTES[kind]:
        raise ValueError(
            f"{kind} tensor of shape {shape} needs {n * k // _BLOCK * _BLOCK_BYTES[kind]} bytes, got {raw.size}"
        )
    blocks = raw.reshape(n * (k // _BLOCK), _BLOCK_BYTES[kind])  # row-major: the blocks of row 0, then row 1...
    d = _f16(blocks, 0)
    groups = (n, k // _BLOCK)
    if kind == "Q8_0":
        q8 = blocks[:, 2:].copy().view(np.int8).reshape(n, k)
        return {"qweight": q8, "scales": d.reshape(groups)}
    nibbles = blocks[:, 4:] if kind == "Q4_1" else blocks[:, 2:]  # (B, 16)
    q = np.concatenate((nibbles & 0xF, nibbles >> 4), axis=1).reshape(n, k)  # element order within a block
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)  # (N, K/2): even k low
    zeros = _f16(blocks, 2) + 8 * d if kind == "Q4_1" else np.zeros_like(d)
    return {"qweight": packed, "scales": d.reshape(groups), "zeros": zeros.reshape(groups).astype(np.float32)}
