"""The decoder-only transformer (Llama, Mistral, Qwen2, Qwen3) over a flattened varlen batch.

Module names mirror the Hugging Face checkpoints (`model.layers.N.self_attn...`) except for the
fused projections, which `CausalLM.packed_modules` maps back to the checkpoint names. RoPE cos/sin
are computed per step from the token positions: no table to size, positions of any length work.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from helexa.kernels import AttentionBackend, get_attention_backend, linear
from helexa.kvcache.metadata import AttentionMetadata
from helexa.model.config import ModelConfig, RopeScaling
from helexa.model.parallel.comm import RowParallelLinear, TensorParallel, VocabParallelEmbedding
from helexa.model.parallel.sharding import ShardPlan

__all__ = ["CausalLM", "MergedLinear", "copy_checked", "rope_inv_freq"]

_Pair = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) of RoPE, or one layer's (k_cache, v_cache)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies `(head_dim // 2,)` float32 on CPU: theta**(-2i/head_dim), then scaled. linear:
    all divided by `factor`; llama3: wavelengths over original/low_freq_factor divided by `factor`, under
    original/high_freq_factor kept, those between blended linearly in original/wavelength."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    if scaling is None or scaling.rope_type == "linear":
        return inv_freq / (scaling.factor if scaling else 1.0)  # (D/2,)
    low, high, original = scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_position_embeddings
    if scaling.rope_type != "llama3" or low is None or high is None or original is None:
        raise ValueError(f"unsupported rope scaling {scaling}")
    wavelen = 2 * math.pi / inv_freq  # (D/2,)
    long_wave, short_wave = wavelen > original / low, wavelen < original / high
    scaled = torch.where(long_wave, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)  # 0 at the long-wave edge (fully scaled), 1 at the short
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    return torch.where(~long_wave & ~short_wave, blended, scaled)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: (T, heads, D) by cos: (T, D) and signed_sin: (T, D), sin with its first half negated,
    the two halves of each head (HF "rotate_half": x * cos + cat(-x2, x1) * sin, the same products)."""
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # (T, heads, D): cat(x2, x1)
    return torch.addcmul(x * cos[:, None, :], swapped, signed_sin[:, None, :])


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into `dst` (casting dtype, moving device); `ValueError` with both shapes if they differ."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch: model expects {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}")
    dst.copy_(src)


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalised in float32, over the last dimension."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., dim) -> (..., dim) in x's dtype."""
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) for x: (T, dim); with `residual=None` the stream starts at x."""
        residual = x if residual is None else x + residual
        return self(residual), residual


class Linear(nn.Linear):
    """`nn.Linear` whose matmul is batch invariant on CUDA (`helexa.kernels.linear`: one tiling for every
    row count, where cuBLAS changes its summation with the batch); elsewhere `F.linear` itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Linear layers of the same input stacked along the output dimension (q|k|v, gate|up), computed
    as one matmul. Checkpoint shard `i` fills `shard_sizes[i]` output rows, after those of shards < i."""

    def __init__(self, in_features: int, shard_sizes: tuple[int, ...], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int) -> None:
        """Copy shard `shard_id`'s full weight (rows, in) or bias (rows,) into its row range of `param`."""
        copy_checked(param.narrow(0, sum(self.shard_sizes[:shard_id]), self.shard_sizes[shard_id]), loaded)


def _row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None) -> nn.Module:
    """o_proj / down_proj: a plain linear on one device, else row-parallel (one all-reduce)."""
    if tp is None:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


class _MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused into one matmul. Under
    tensor parallelism `intermediate_size` is this rank's share and down_proj all-reduces."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, (intermediate_size, intermediate_size), bias=bias)
        self.down_proj = _row_linear(intermediate_size, hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, I) each
        return self.down_proj(F.silu(gate) * up)


class _Attention(nn.Module):
    """GQA attention: q/k/v from one fused matmul, per-head q/k RMSNorm (Qwen3), RoPE, the new K/V
    written to this layer's cache with `write_kv`, then `paged_attention` over the block tables. Under
    tensor parallelism the heads are this rank's (`plan`) and o_proj all-reduces."""

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, plan: ShardPlan, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = plan.num_heads, plan.num_kv_heads
        self.head_dim, self.q_size, self.kv_size = config.head_dim, plan.q_size, plan.kv_size
        self.backend = backend
        self.qkv_proj = MergedLinear(config.hidden_size, (self.q_size, self.kv_size, self.kv_size), config.qkv_bias)
        self.o_proj = _row_linear(self.q_size, config.hidden_size, config.o_bias, tp)
        # Without per-head q/k norms (all but Qwen3) they are parameter-free identities.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, rope: _Pair, attn: AttentionMetadata, kv_cache: _Pair) -> torch.Tensor:
        """x: (T, hidden); rope: cos, sin (T, D); kv_cache: (k, v), each (NB, BS, KVH, D). Returns
        (T, hidden); the K/V of the T new tokens are written to their slots in the caches."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, q_size + 2 kv_size)
        heads = self.num_heads + self.num_kv_heads
        if isinstance(self.q_norm, nn.Identity):  # q and k rotated in one pass over their joint view
            qk = qkv[:, : self.q_size + self.kv_size].reshape(num_tokens, heads, self.head_dim)  # (T, H + KVH, D)
        else:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            qk = torch.cat(
                (
                    self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim)),
                    self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim)),
                ),
                dim=1,
            )  # (T, H + KVH, D)
        q, k = _apply_rope(qk, *rope).split((self.num_heads, self.num_kv_heads), dim=1)  # (T, H, D), (T, KVH, D)
        v = qkv[:, self.q_size + self.kv_size :].reshape(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        scales = getattr(kv_cache, "scales", {})  # an fp8 pool's k_scale, v_scale (helexa.kvcache.LayerKV)
        self.backend.write_kv(k, v, *kv_cache, attn.slot_mapping, **scales)
        out = self.backend.paged_attention(
            q, *kv_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, scale=self.head_dim**-0.5, **scales
        )  # (T, H, D)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class _DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); each residual add is folded into the
    following norm (`RMSNorm.add_forward`)."""

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, plan: ShardPlan, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _Attention(config, backend, plan, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _MLP(config.hidden_size, plan.intermediate_size, bias=config.mlp_bias, tp=tp)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: _Pair, attn: AttentionMetadata, kv_cache: _Pair
    ) -> _Pair:
        """hidden, residual: (T, E) -> (mlp output, residual stream before it), both (T, E)."""
        hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(hidden, rope, attn, kv_cache)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class _Backbone(nn.Module):
    """Embedding, decoder layers and final norm (the checkpoint's `model.` prefix)."""

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, plan: ShardPlan, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = (
            # `_weight`: no initialiser (the loader fills every weight; nn.Embedding's normal_ on the meta
            # device would import torch._dynamo, ~70 MiB resident for nothing)
            nn.Embedding(
                config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
            )
            if tp is None
            else VocabParallelEmbedding(config.hidden_size, tp)
        )
        self.layers = nn.ModuleList(_DecoderLayer(config, backend, plan, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """A causal language model on the paged KV cache; every layer calls the attention backend bound
    here (`write_kv`, then `paged_attention`; no other attention path). The loader builds it on `meta`
    and may swap its linear layers and embedding for quantized ones (`helexa.model.quant`).

    `native_step`, when the loader sets it (a quantized model on the CPU with the reference backend:
    `helexa.model.quant.native_step`), runs every step — decode, prefill, chunked, extend, mixed —
    from token ids to the sampled rows' logits in one native call: the same K/V writes into the same caches and
    the reference backend's attention, computed in C, each row by one computation whatever else
    shares the step (batch invariant, bit for bit). A step it declines (an fp8 cache) takes the layers.

    With `tp` (tensor parallelism, `helexa.model.parallel`) it holds one rank's shard (`plan`): its heads,
    MLP rows and vocabulary rows; o_proj and down_proj all-reduce, the embedding is vocab-parallel and
    the logits of every rank's vocabulary rows are gathered to rank 0. Every rank must run the same
    forward at the same time. Without `tp` the plan is the whole model and nothing communicates."""

    # Fused module -> the checkpoint modules stacked in it, in row order.
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(
        self, config: ModelConfig, attention_backend: str | AttentionBackend = "auto", tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        if not isinstance(attention_backend, AttentionBackend):
            attention_backend = get_attention_backend(attention_backend)
        self.config = config
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.plan = tp.plan if self.tp is not None and tp is not None else ShardPlan.for_model(config)
        self.model = _Backbone(config, attention_backend, self.plan, self.tp)
        # (hidden, positions, attn, kv_caches, logits_indices) -> logits (S, V), or None to take the layers
        self.native_step: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, self.plan.vocab_rows, bias=False)
        )
        self._rope_args = (config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer(
            "inv_freq", rope_inv_freq(*self._rope_args).to(torch.get_default_device()), persistent=False
        )

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute the RoPE frequencies on `device` (for a model built on the meta device)."""
        self.inv_freq = rope_inv_freq(*self._rope_args).to(device)  # (D/2,) float32

    @property
    def output_weight(self) -> torch.Tensor:  # (V, E) of a dense head (this rank's rows): the embedding when tied
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        if not isinstance(head, nn.Embedding | nn.Linear | VocabParallelEmbedding):
            raise TypeError(f"the output head is quantized ({type(head).__name__}); it has no dense weight")
        return head.weight

    @property
    def dtype(self) -> torch.dtype:  # of the activations, the KV cache and the dense weights
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:  # holding the weights
        return self.model.norm.weight.device

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (S, E), final-normed -> (S, V) float32 through the head (tied: the embedding table).
        Tensor-parallel: each rank's vocabulary rows, gathered to rank 0; the other ranks get (S, 0)."""
        if self.tp is not None:
            return self.tp.gather_vocab(F.linear(rows, self.output_weight).float())  # (S, V) on rank 0
        if self.lm_head is not None:
            return self.lm_head(rows).float()
        embed: Any = self.model.embed_tokens
        if isinstance(embed, nn.Embedding):
            return linear(rows, embed.weight).float()
        return embed.logits(rows)  # a quantized table (QuantEmbedding)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: Sequence[_Pair],
        logits_indices: torch.Tensor,
        reuse_logits: bool = False,
    ) -> torch.Tensor:
        """One step of a flattened varlen batch: logits (S, V) float32 of the rows to sample.

        input_ids, positions: (T,) int64, the new tokens of all sequences back to back; attn: the
        step's metadata; kv_caches: one (k_cache, v_cache) per layer, each (NB, BS, KVH, D) in the
        model dtype, into which the new tokens' K/V are written; logits_indices: (S,) int64 rows.
        Tensor-parallel ranks other than 0 return an empty (S, 0): the logits are gathered to rank 0.
        `reuse_logits`: the caller reads these logits before its next call, so the fused CPU step may return
        them in a buffer that call overwrites (no fresh pages a step); every other path returns its own.
        """
        return self.forward_rows(input_ids, positions, attn, kv_caches, logits_indices, reuse_logits=reuse_logits)[0]

    @torch.inference_mode()
    def forward_rows(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: Sequence[_Pair],
        logits_indices: torch.Tensor,
        argmax_indices: torch.Tensor | None = None,
        argmax_cols: int | None = None,
        reuse_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s logits (S, V) of rows `logits_indices`, and for rows `argmax_indices` (A,) int64 (default
        none) only their tokens (A,) int64: the index `argmax` gives of each one's logits over columns
        [0, `argmax_cols`) (default V; the first of equal maxima, the first NaN where there is one). The fused
        CPU step never stores those rows' logits (it folds the head's argmax a block of columns at a time);
        every other path computes them and takes the argmax, the same tokens. Under tensor parallelism only
        rank 0 may ask for argmax rows (the others hold no logits)."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be [T], got {tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} (k_cache, v_cache) pairs, got {len(kv_caches)}")
        if attn.num_tokens != input_ids.shape[0]:
            raise ValueError(f"attention metadata has {attn.num_tokens} slots for {input_ids.shape[0]} tokens")
        argmax = logits_indices.new_empty(0) if argmax_indices is None else argmax_indices
        if logits_indices.dim() != 1 or argmax.dim() != 1:
            raise ValueError(
                f"logits_indices and argmax_indices must be [S] and [A], got {tuple(logits_indices.shape)}"
                f" and {tuple(argmax.shape)}"
            )
        cols = self.config.vocab_size if argmax_cols is None else argmax_cols
        if argmax.numel() and not 0 < cols <= self.config.vocab_size:
            raise ValueError(f"argmax_cols must be in [1, {self.config.vocab_size}], got {cols}")

        if self.native_step is not None:  # it embeds the tokens itself, a piece of the step at a time
            out = self.native_step(input_ids, positions, attn, kv_caches, logits_indices, reuse_logits, argmax, cols)
            if out is not None:
                return out  # (S, V), (A,)
        hidden = self.model.embed_tokens(input_ids)  # (T, E)
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # (T, D/2) float32
        angles = torch.cat((angles, angles), dim=-1)  # (T, D)
        sin = angles.sin()
        sin[:, : sin.shape[1] // 2].neg_()  # signed for `_apply_rope`
        rope = angles.cos().to(hidden.dtype), sin.to(hidden.dtype)  # (T, D) each
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(hidden, residual, rope, attn, kv_cache)
        assert residual is not None  # ModelConfig guarantees at least one layer
        # Only the rows that are sampled need the final norm and the vocab projection.
        if not argmax.numel():  # the common case (every forward on a GPU): no concatenation, one launch fewer
            rows = self.model.norm(hidden[logits_indices] + residual[logits_indices])  # (S, E)
            return self.logits(rows), argmax.new_empty(0, dtype=torch.int64)
        every = torch.cat((logits_indices, argmax.to(logits_indices.device)))  # (S + A,)
        rows = self.model.norm(hidden[every] + residual[every])  # (S + A, E)
        logits = self.logits(rows)  # (S + A, V)
        s = logits_indices.shape[0]
        if logits.shape[1] == 0:
            raise ValueError("argmax rows are rank 0's: this tensor-parallel rank holds no logits")
        return logits[:s], logits[s:, :cols].argmax(dim=-1)  # (S, V), (A,)
