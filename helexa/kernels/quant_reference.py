"""Pure-torch references for the weight-only quantized matmuls (W8A16, W4A16), and the CPU fallback.

Weight layouts (the contract the model side and the Triton kernels in `quant_matmul` share):

- int8, per output channel: `qweight` int8 (N, K), `scales` (N,); W[n, k] = qweight[n, k] * scales[n].
- int8, group-wise: `qweight` int8 (N, K), `scales` (N, K // G);
  W[n, k] = qweight[n, k] * scales[n, k // G]   (GGUF Q8_0: G = 32).
- int4, group-wise: `qweight` uint8 (N, K // 2), two 4-bit values q in [0, 15] per byte, the LOW
  nibble holding even k (k = 2j) and the HIGH nibble odd k (k = 2j + 1); `scales` and `zeros`
  (N, K // G); W[n, k] = (q[n, k] - 8) * scales[n, k // G] + zeros[n, k // G].

scales/zeros may be float32, float16 or bfloat16. The group size G is implied by the shapes:
G = K // scales.shape[1]. The matmuls take activations x (M, K) in float32/float16/bfloat16 and
return x @ W.T (M, N) in x's dtype; the Triton kernels accept exactly what these references
accept (`check_int8_matmul` / `check_int4_matmul`: G divides K, G % 32 == 0, K % 32 == 0), so a
model that runs on the CPU fallback runs on the GPU kernels too. Every check raises ValueError.
"""

from __future__ import annotations

import torch

__all__ = [
    "ACTIVATION_DTYPES",
    "SCALE_DTYPES",
    "check_int4_matmul",
    "check_int8_matmul",
    "dequantize_int4",
    "dequantize_int8",
    "int4_matmul_reference",
    "int8_matmul_reference",
    "pack_int4",
    "unpack_int4",
]

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_K_MULTIPLE = 32  # K and G must be multiples of this (the smallest K step of the Triton kernels)


# ---------------------------------------------------------------------------------------------
# argument checks (shared with the Triton wrappers)
# ---------------------------------------------------------------------------------------------
def _scale_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SCALE_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def _group_size(k: int, scales: torch.Tensor, what: str) -> int:
    """G = K // scales.shape[1] for (N, K // G) scales; raises unless G is a positive divisor of K."""
    groups = scales.shape[1]
    if groups == 0 or k % groups != 0:
        raise ValueError(f"{what}: scales has {groups} groups per row, which does not divide K = {k}")
    return k // groups


def _check_int8_layout(qweight: torch.Tensor, scales: torch.Tensor) -> int:
    """qweight int8 (N, K); scales (N,) or (N, K // G) float. Returns G (K for per-channel scales)."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"int8 qweight must be a 2-D int8 tensor (N, K), got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape
    _scale_dtype("scales", scales)
    if scales.dim() == 1:
        if scales.shape[0] != n:
            raise ValueError(f"per-channel scales must be ({n},), got {tuple(scales.shape)}")
        return k
    if scales.dim() != 2 or scales.shape[0] != n:
        raise ValueError(f"scales must be ({n},) or ({n}, K // G), got {tuple(scales.shape)}")
    return _group_size(k, scales, "int8")


def _check_int4_layout(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> int:
    """qweight uint8 (N, K // 2); scales and zeros (N, K // G) float, one shape. Returns G."""
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(
            f"int4 qweight must be a 2-D uint8 tensor (N, K // 2), got {qweight.dtype} {tuple(qweight.shape)}"
        )
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    _scale_dtype("scales", scales)
    _scale_dtype("zeros", zeros)
    if scales.dim() != 2 or scales.shape[0] != n:
        raise ValueError(f"int4 scales must be ({n}, K // G), got {tuple(scales.shape)}")
    if zeros.shape != scales.shape:
        raise ValueError(f"zeros shape {tuple(zeros.shape)} != scales shape {tuple(scales.shape)}")
    group = _group_size(k, scales, "int4")
    if group % 2:
        raise ValueError(f"int4 group size must be even, got {group}")
    return group


def _check_activations(x: torch.Tensor, k: int, *weights: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K), got {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.shape[1] != k:
        raise ValueError(f"x has K = {x.shape[1]} but the weight has K = {k}")
    for t in weights:
        if t.device != x.device:
            raise ValueError(f"all tensors must be on x's device {x.device}, got one on {t.device}")


def _check_kernel_shape(k: int, group: int) -> None:
    """The shape rules of the matmuls (both paths): K > 0; K and G multiples of 32."""
    if k <= 0 or k % _K_MULTIPLE:
        raise ValueError(f"K = {k} must be a positive multiple of {_K_MULTIPLE}")
    if group % _K_MULTIPLE:
        raise ValueError(f"group size G = {group} must be a multiple of {_K_MULTIPLE}")


def check_int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> int:
    """Validate `int8_matmul`'s arguments; returns G, or 0 for per-channel (1-D) scales.

    x (M, K) float32/float16/bfloat16; qweight int8 (N, K); scales (N,) or (N, K // G) with G % 32 == 0;
    K % 32 == 0; all on x's device. Raises ValueError naming the first rule broken."""
    group = _check_int8_layout(qweight, scales)
    k = qweight.shape[1]
    _check_activations(x, k, qweight, scales)
    _check_kernel_shape(k, group)
    return 0 if scales.dim() == 1 else group


def check_int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> int:
    """Validate `int4_matmul`'s arguments; returns G.

    x (M, K) float32/float16/bfloat16; qweight uint8 (N, K // 2); scales, zeros (N, K // G) with
    G % 32 == 0; K % 32 == 0; all on x's device. Raises ValueError naming the first rule broken."""
    group = _check_int4_layout(qweight, scales, zeros)
    k = 2 * qweight.shape[1]
    _check_activations(x, k, qweight, scales, zeros)
    _check_kernel_shape(k, group)
    return group


# ---------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit values: q (N, K) integer tensor with values in [0, 15], K even -> (N, K // 2) uint8,
    byte j of a row = q[:, 2j] | q[:, 2j + 1] << 4 (even k in the low nibble). Raises ValueError for
    another shape or dtype, or a value outside [0, 15] (this check reads the values on the host)."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"pack_int4 needs a 2-D tensor with an even number of columns, got {tuple(q.shape)}")
    if q.dtype.is_floating_point or q.dtype.is_complex or q.dtype == torch.bool:
        raise ValueError(f"pack_int4 needs an integer tensor, got {q.dtype}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError(f"pack_int4 values must lie in [0, 15], got [{int(q.min())}, {int(q.max())}]")
    q8 = q.to(torch.uint8)
    return q8[:, 0::2] | (q8[:, 1::2] << 4)  # (N, K // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: packed (N, K // 2) uint8 -> q (N, K) uint8 with values in [0, 15]."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"unpack_int4 needs a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    low, high = packed & 0xF, packed >> 4  # (N, K // 2) each: even k, odd k
    return torch.stack((low, high), dim=-1).flatten(1)  # (N, K)


# ---------------------------------------------------------------------------------------------
# dequantization and the matmuls
# ---------------------------------------------------------------------------------------------
def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W (N, K) in `dtype` (float32 by default): qweight[n, k] * scales[n] for (N,) scales, or
    qweight[n, k] * scales[n, k // G] for (N, K // G) scales, computed in `dtype`."""
    group = _check_int8_layout(qweight, scales)
    s = scales.to(dtype)
    s = s[:, None] if scales.dim() == 1 else s.repeat_interleave(group, dim=1)  # (N, 1) or (N, K)
    return qweight.to(dtype) * s


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W (N, K) in `dtype` (float32 by default): (q[n, k] - 8) * scales[n, k // G] + zeros[n, k // G],
    q unpacked from the low (even k) and high (odd k) nibbles of qweight (N, K // 2)."""
    group = _check_int4_layout(qweight, scales, zeros)
    q = unpack_int4(qweight).to(dtype) - 8  # (N, K)
    s = scales.to(dtype).repeat_interleave(group, dim=1)  # (N, K)
    z = zeros.to(dtype).repeat_interleave(group, dim=1)  # (N, K)
    return q * s + z


def int8_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ dequantize_int8(qweight, scales).T in float32, returned (M, N) in x's dtype.
    Same argument rules as the Triton kernel (`check_int8_matmul`)."""
    check_int8_matmul(x, qweight, scales)
    return (x.float() @ dequantize_int8(qweight, scales).T).to(x.dtype)


def int4_matmul_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """x (M, K) @ dequantize_int4(qweight, scales, zeros).T in float32, returned (M, N) in x's dtype.
    Same argument rules as the Triton kernel (`check_int4_matmul`)."""
    check_int4_matmul(x, qweight, scales, zeros)
    return (x.float() @ dequantize_int4(qweight, scales, zeros).T).to(x.dtype)
