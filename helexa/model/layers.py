"""Building blocks of the decoder: RMSNorm, linear layers with weight-loader hooks, MLP, attention.

Every layer that owns parameters has a `weight_loader(param, loaded, shard_id)` method: it receives
the *full* checkpoint tensor and copies it (or the part `shard_id` names) into the destination
parameter. Fused layers (q/k/v, gate/up) place each checkpoint tensor at its rows. Tensor
parallelism, when it comes, narrows `loaded` to the rank's slice inside these hooks (column split
for `QKVLinear`/`MergedLinear`, row split for the `Linear` layers feeding the residual) — the
model and the loader stay as they are.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from helexa.kernels import AttentionBackend
from helexa.kvcache.metadata import AttentionMetadata
from helexa.model.config import ModelConfig
from helexa.model.rope import apply_rope

__all__ = [
    "Attention",
    "Embedding",
    "Linear",
    "MLP",
    "MergedLinear",
    "QKVLinear",
    "RMSNorm",
    "copy_checked",
]


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into `dst` (casting dtype, moving device). Raises `ValueError` with both shapes
    when they differ."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch: model expects {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}")
    dst.copy_(src)


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalised in float32, over the last dimension."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # (dim,)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        """Copy the full (dim,) weight."""
        copy_checked(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., dim) -> (..., dim) in x's dtype."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold `x` into the residual stream, then normalise: returns (norm(x + residual), x + residual).

        x, residual: (T, dim). With `residual=None` (the first layer) the stream starts at x.
        """
        residual = x if residual is None else x + residual
        return self(residual), residual


class Linear(nn.Linear):
    """A plain linear layer whose checkpoint tensor maps one-to-one onto its parameter."""

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        """Copy the full checkpoint tensor (weight (out, in) or bias (out,))."""
        copy_checked(param, loaded)


class Embedding(nn.Embedding):
    """Token embedding table `(vocab, hidden)`; also the output projection when embeddings are tied."""

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        """Copy the full (vocab, hidden) table."""
        copy_checked(param, loaded)


class MergedLinear(nn.Linear):
    """Several linear layers of the same input stacked along the output dimension (e.g. gate|up),
    computed as one matmul. `shard_sizes[i]` output rows belong to checkpoint shard `i`."""

    def __init__(self, in_features: int, shard_sizes: tuple[int, ...], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    @property
    def shard_ids(self) -> tuple[Hashable, ...]:
        """The `shard_id`s the loader must deliver, one per stacked layer."""
        return tuple(range(len(self.shard_sizes)))

    def _rows(self, shard_id: Hashable) -> tuple[int, int]:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.shard_sizes):
            raise ValueError(f"shard_id must be in {list(self.shard_ids)}, got {shard_id!r}")
        start = sum(self.shard_sizes[:shard_id])
        return start, self.shard_sizes[shard_id]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        """Copy one stacked layer's full weight (rows, in) or bias (rows,) into its row range."""
        start, size = self._rows(shard_id)
        copy_checked(param.narrow(0, start, size), loaded)


class QKVLinear(MergedLinear):
    """The fused q/k/v projection: output rows [q (H*D) | k (KVH*D) | v (KVH*D)]."""

    _SHARDS = ("q", "k", "v")

    def __init__(self, hidden_size: int, q_size: int, kv_size: int, bias: bool) -> None:
        super().__init__(hidden_size, (q_size, kv_size, kv_size), bias=bias)

    @property
    def shard_ids(self) -> tuple[Hashable, ...]:
        return self._SHARDS

    def _rows(self, shard_id: Hashable) -> tuple[int, int]:
        if shard_id not in self._SHARDS:
            raise ValueError(f"shard_id must be one of {self._SHARDS}, got {shard_id!r}")
        return super()._rows(self._SHARDS.index(shard_id))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, (intermediate_size, intermediate_size), bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, I) each
        return self.down_proj(F.silu(gate) * up)


class Attention(nn.Module):
    """Multi-head attention with GQA over the paged KV cache.

    q/k/v from one fused matmul; optional per-head RMSNorm of q and k (Qwen3); RoPE at the token
    positions; the new K/V written into this layer's cache with `write_kv`; then `paged_attention`
    over the block tables — the only attention path.
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.head_dim**-0.5
        self.backend = backend
        self.qkv_proj = QKVLinear(config.hidden_size, config.q_size, config.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """x: (T, hidden); cos, sin: (T, D); k_cache, v_cache: (NB, BS, KVH, D). Returns (T, hidden).

        Side effect: the K/V of the T new tokens are written to their slots in the caches.
        """
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, (H + 2*KVH) * D)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)  # (T, H, D)
        k = apply_rope(k, cos, sin)  # (T, KVH, D)
        self.backend.write_kv(k, v.contiguous(), k_cache, v_cache, attn.slot_mapping)
        out = self.backend.paged_attention(
            q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, scale=self.scale
        )  # (T, H, D)
        return self.o_proj(out.reshape(num_tokens, self.q_size))
