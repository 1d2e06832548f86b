"""The decoder-only transformer (Llama, Mistral, Qwen2, Qwen3) over a flattened varlen batch.

Module names mirror the Hugging Face checkpoints (`model.layers.N.self_attn...`) except for the
fused projections, which `CausalLM.packed_modules` maps back to the checkpoint names.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from helexa.kernels import AttentionBackend, get_attention_backend
from helexa.kvcache.metadata import AttentionMetadata
from helexa.model.config import ModelConfig
from helexa.model.layers import MLP, Attention, Embedding, Linear, RMSNorm
from helexa.model.rope import RotaryEmbedding

__all__ = ["CausalLM", "DecoderLayer"]

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); the residual add is folded into the
    following norm (`RMSNorm.add_forward`)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, residual: (T, E) -> (mlp output, residual stream before it), both (T, E)."""
        hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, attn, kv_cache[0], kv_cache[1])
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class _Backbone(nn.Module):
    """Embedding, decoder layers and final norm (the checkpoint's `model.` prefix)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """A causal language model running on the paged KV cache.

    Built on any device (the loader builds it on `meta` and materialises it from the checkpoint).
    The attention backend is bound once here; every layer calls its `write_kv` then
    `paged_attention` — there is no other attention path.
    """

    # Fused module -> the checkpoint modules stacked in it, with the shard_id each one loads as.
    packed_modules: dict[str, tuple[tuple[str, Hashable], ...]] = {
        "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
        "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    }

    def __init__(self, config: ModelConfig, attention_backend: str | AttentionBackend = "auto") -> None:
        super().__init__()
        backend = (
            attention_backend
            if isinstance(attention_backend, AttentionBackend)
            else get_attention_backend(attention_backend)
        )
        self.config = config
        self.attention_backend = backend
        self.model = _Backbone(config, backend)
        self.rotary_emb = RotaryEmbedding(config)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights and activations (and so of the KV cache the model expects)."""
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        """The device holding the weights."""
        return self.model.embed_tokens.weight.device

    @property
    def output_weight(self) -> torch.Tensor:
        """The (V, E) output projection: the embedding table when tied, else `lm_head.weight`."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: KVCaches,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run one step of a flattened varlen batch and return logits for the rows to sample.

        input_ids: (T,) int64 new tokens of all sequences back to back; positions: (T,) int64
        their positions; attn: the step's metadata (slot_mapping, block tables, lengths);
        kv_caches: one (k_cache, v_cache) per layer, each (NB, BS, KVH, D) in the model dtype;
        logits_indices: (S,) int64 rows of the T tokens that need logits.
        Returns (S, V) float32. Writes the new tokens' K/V into their cache slots; the final norm
        and lm_head run on the S gathered rows only.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be [T], got {tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} (k_cache, v_cache) pairs, got {len(kv_caches)}")
        if attn.num_tokens != input_ids.shape[0]:
            raise ValueError(f"attention metadata has {attn.num_tokens} slots for {input_ids.shape[0]} tokens")
        if logits_indices.dim() != 1:
            raise ValueError(f"logits_indices must be [S], got {tuple(logits_indices.shape)}")

        hidden = self.model.embed_tokens(input_ids)  # (T, E)
        cos, sin = self.rotary_emb(positions, hidden.dtype)  # (T, D) each
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(hidden, residual, cos, sin, attn, kv_cache)
        # Only the rows that are sampled need the final norm and the vocab projection.
        rows = hidden[logits_indices] + residual[logits_indices]  # (S, E)
        rows = self.model.norm(rows)  # (S, E)
        return F.linear(rows, self.output_weight).float()  # (S, V)
