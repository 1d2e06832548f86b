"""Rotary position embeddings (RoPE) with optional `linear` or `llama3` frequency scaling.

cos/sin are computed per step from the token positions (T x head_dim/2 multiplies), so there is
no table to size by the longest context and positions of any length work.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from helexa.model.config import ModelConfig, RopeScaling

__all__ = ["RotaryEmbedding", "apply_rope", "rope_inv_freq"]


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies `(head_dim // 2,)` float32 on CPU: theta**(-2i/head_dim), then scaled.

    linear: all divided by `factor`. llama3: wavelengths longer than
    original/low_freq_factor divided by `factor`, shorter than original/high_freq_factor kept,
    and those in between blended linearly in (original / wavelength).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim  # (D/2,)
    inv_freq = 1.0 / (theta**exponents)  # (D/2,)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
        assert scaling.original_max_position_embeddings is not None
        original = scaling.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq  # (D/2,)
        long_wave = wavelen > original / scaling.low_freq_factor
        short_wave = wavelen < original / scaling.high_freq_factor
        scaled = torch.where(long_wave, inv_freq / scaling.factor, inv_freq)
        # Blend weight: 0 at the long-wave edge (fully scaled), 1 at the short-wave edge (unscaled).
        smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        return torch.where(~long_wave & ~short_wave, blended, scaled)
    raise ValueError(f"unsupported rope type {scaling.rope_type!r}")


class RotaryEmbedding(nn.Module):
    """Produces `(cos, sin)`, each `(T, head_dim)` in the activation dtype, for token positions."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        self.scaling = config.rope_scaling
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(torch.get_default_device())
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (D/2,) float32

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute `inv_freq` on `device` (for a module built on the meta device)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) int. Returns cos, sin: (T, head_dim) in `dtype`, angles in float32."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # (T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: (T, heads, D) by angles cos/sin: (T, D), rotating the two halves of each head
    (the Hugging Face "rotate_half" layout). Returns a new (T, heads, D) tensor."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (T, heads, D)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
