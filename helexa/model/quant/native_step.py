"""The fused CPU step (`csrc/step.c`): every layer of a quantized model in one native call, for every
step: decode, prefill, a chunk of a chunked prefill, an extend after a prefix-cache hit, or any mix.

Two reasons it serves every step. Speed: on a CPU, a step of a small model is dominated not by its
matmuls but by the few dozen torch operations around them in every layer (norms, RoPE, the cache
write, attention, activations), each a dispatch of ~10 µs. Determinism: a token's logits and K/V
must not depend on what else shares the step or how its sequence was split into steps; the C step
computes each row by the same operations in the same order whatever the batch (per-row projections,
norms and activations, RoPE from the row's own position, attention split at fixed key positions and
merged in a fixed order; csrc/step.c says how), so one computation per row and per position is the
whole guarantee. It computes what `CausalLM`'s torch layers compute with the reference attention
backend, in float32, through the same quantized kernel (`native`), writing K/V into the same paged
caches through the same block tables.

`native_step_for(model)` decides once, at load, whether a model can use it and says why not: CPU,
float32, no tensor parallelism, the reference attention backend, every decoder projection quantized
for the native kernel, head_dim a multiple of 8 up to 512, at most 16 query heads per KV head. Each
step still checks what varies (float32 or float16 caches with a contiguous last dimension, index dtypes); a step
that does not fit (an fp8 cache) takes the torch layers. `HELEXA_CPU_STEP=torch` turns it off.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from helexa.kvcache.metadata import AttentionMetadata
from helexa.model.quant import native
from helexa.model.quant.linear import QuantEmbedding, QuantLinear

__all__ = ["NativeStep", "native_step_for", "paged_attention"]

_p, _i64 = ctypes.c_void_p, ctypes.c_int64
_MAX_HEAD_DIM = 512  # the C code's per-head buffers
_MAX_GROUP = 16  # query heads per KV head (GMAX)
# Most rows one native call computes: a step of more (a long prefill chunk) runs as consecutive calls, so
# the C step's scratch (every row's activations in every buffer of a layer) and the embeddings the Python
# side holds stay those of 256 rows (a 4,096-token prompt on a 1B model: peak 1,358 -> 1,300 MiB; the
# embeddings of a 2,048-token chunk of it, 16 MiB, -> 2 MiB). Each row is one computation whatever
# shares its call (see the module doc), so no bit changes; each call reads the weights once more,
# which a 256-row prefill piece (seconds of compute) does not notice.
STEP_ROWS = 256


class _Linear(ctypes.Structure):
    _fields_ = [
        ("weight", _p), ("scales", _p), ("zero_terms", _p), ("bias", _p),
        ("n", _i64), ("k", _i64), ("group", _i64), ("int4", _i64), ("half", _i64),
    ]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p),
        ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
        ("k_cache", _p), ("v_cache", _p), ("block_stride", _i64), ("row_stride", _i64), ("head_stride", _i64),
        ("kv_half", _i64),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
        ("intermediate", _i64), ("block_size", _i64), ("eps", ctypes.c_double), ("final_norm", _p),
        ("layers", ctypes.POINTER(_Layer)),
    ]  # fmt: skip


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear(module: Any, keep: list[torch.Tensor]) -> _Linear | None:
    """The C view of a projection, or None when it is not a native-kernel quantized linear."""
    cpu = module.cpu_matmul if isinstance(module, QuantLinear) else None
    if cpu is None or cpu.tiled is None:
        return None
    tiled = cpu.tiled
    bias = None if module.bias is None else module.bias.detach().float().contiguous()
    keep.extend(t for t in (*tiled, bias) if t is not None)
    n, k = cpu.shape
    zero_terms = tiled[2] if len(tiled) == 3 else None
    group = k // tiled[1].shape[1]
    half = tiled[1].dtype == torch.float16
    return _Linear(
        tiled[0].data_ptr(), tiled[1].data_ptr(), _ptr(zero_terms), _ptr(bias), n, k, group, len(tiled) == 3, half
    )


def _norm_weight(module: Any, keep: list[torch.Tensor]) -> int | None:
    weight = getattr(module, "weight", None)
    if weight is None:
        return None
    w = weight.detach().float().contiguous()
    keep.append(w)
    return w.data_ptr()


CACHE_DTYPES = (torch.float32, torch.float16)  # the KV cache dtypes the step reads and writes


def _cache_ok(k: torch.Tensor, v: torch.Tensor) -> bool:
    return (
        k.dtype == v.dtype
        and k.dtype in CACHE_DTYPES
        and k.dim() == 4
        and k.stride() == v.stride()
        and k.stride(-1) == 1
        and not k.is_cuda
    )


class NativeStep:
    """A model's decoder stack as one native call per step (build it with `native_step_for`). Holds its
    own float32 copies of the norm weights and biases; the projections' tiled weights are the ones
    their `CpuQuantMatmul` prepared."""

    def __init__(
        self,
        model: Any,
        layers: list[_Layer],
        keep: list[torch.Tensor],
        final_norm: int,
        head: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        config, plan = model.config, model.plan
        self._keep = keep  # everything the C structures point to
        self._embed = model.model.embed_tokens  # token ids (R,) -> embeddings (R, E), looked up per piece
        self._head = head  # final-normed rows (S, E) -> logits (S, V), each row on its own
        self._layers = (_Layer * len(layers))(*layers)
        self._model = _Model(
            len(layers), config.hidden_size, plan.num_heads, plan.num_kv_heads, config.head_dim,
            plan.intermediate_size, 0, config.rms_norm_eps, final_norm, self._layers,
        )  # fmt: skip
        self._inv_freq = model.inv_freq.detach().float().cpu().contiguous()  # (D/2,) RoPE frequencies
        self._caches_key: tuple[int, ...] = ()
        native.library()  # built and loaded now: the first step pays nothing

    def _bind_caches(self, kv_caches: list[Any]) -> bool:
        """Point the layers at these caches (once per pool); False when a cache does not fit."""
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if key == self._caches_key:
            return True
        if len(kv_caches) != len(self._layers) or not all(_cache_ok(*pair) for pair in kv_caches):
            return False
        for layer, (k, v) in zip(self._layers, kv_caches):
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
            layer.block_stride, layer.row_stride, layer.head_stride = k.stride(0), k.stride(1), k.stride(2)
            layer.kv_half = k.dtype == torch.float16
        self._model.block_size = kv_caches[0][0].shape[1]
        self._caches_key = key
        return True

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[Any],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor | None:
        """The logits (S, V) float32 of one step's rows `logits_indices` (S,): input_ids (T,) the new tokens,
        positions (T,) int64 theirs, `attn` the step's metadata; the new K/V are written to the caches.
        Each piece of at most `STEP_ROWS` rows is embedded when its call comes (a long prefill holds one
        piece's embeddings, not the whole chunk's). None, with nothing written, when the step or the caches
        do not fit (then the caller runs the torch layers)."""
        t = input_ids.shape[0]
        if attn.num_tokens != t or positions.shape != (t,) or t == 0:
            return None
        tables, lens, slots, starts = attn.block_tables, attn.seq_lens, attn.slot_mapping, attn.query_start_loc
        if any(x.dtype != torch.int32 for x in (tables, lens, starts)) or slots.dtype != torch.int64:
            return None
        if tables.stride(-1) != 1 or not self._bind_caches(kv_caches):
            return None
        positions, lens, slots, starts = (v.contiguous() for v in (positions.long(), lens, slots, starts))
        # The final-normed rows: a piece's at a time, the rows to sample gathered from each.
        out = torch.empty(min(t, STEP_ROWS), self._model.hidden)  # (rows, E)
        picked = torch.empty(logits_indices.shape[0], self._model.hidden) if t > STEP_ROWS else None  # (S, E)
        for a, b, piece_starts, piece_lens, piece_tables in _pieces(starts, lens, tables, t, STEP_ROWS):
            x = self._residual_stream(input_ids[a:b])
            rc = native.library().helexa_step(
                ctypes.byref(self._model), b - a, x.data_ptr(), positions[a:b].data_ptr(),
                self._inv_freq.data_ptr(), slots[a:b].data_ptr(), piece_lens.shape[0], piece_starts.data_ptr(),
                piece_tables.data_ptr(), piece_tables.stride(0), piece_lens.data_ptr(), out.data_ptr(),
            )  # fmt: skip
            _check(rc, "the native step")
            if picked is not None:
                here = (logits_indices >= a) & (logits_indices < b)  # (S,)
                picked[here] = out[logits_indices[here] - a]
        return self._head(out[logits_indices] if picked is None else picked)

    def _residual_stream(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings (R, E) float32 of `ids` (R,) as a tensor the step may update in place: the lookup's
        own result when it is the whole of its storage (a fresh lookup), else a copy (never a table's rows)."""
        x = self._embed(ids)
        if x.dtype != torch.float32:
            raise TypeError(f"the fused step runs float32 embeddings, got {x.dtype}")
        return x if _owns_its_storage(x) else x.contiguous().clone()


def _owns_its_storage(t: torch.Tensor) -> bool:
    """True when `t` is a contiguous float32 tensor that is the whole of its storage (a fresh embedding
    lookup, not a view into a table): the step may then update it in place as its residual stream."""
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * 4


def _pieces(
    starts: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor, t: int, rows: int
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A step's `t` rows as consecutive native calls of at most `rows` rows each: (first row, end row,
    query_start_loc, seq_lens, block_tables) of each piece. A sequence cut by a piece's end keeps its
    earlier rows in that piece with its length shortened to match; its later rows attend, in the next
    piece, to the K/V the earlier one wrote in every layer. One piece (the step's own metadata) when
    `t <= rows`."""
    if t <= rows:
        yield 0, t, starts, lens, tables
        return
    bounds, lengths = starts.tolist(), lens.tolist()
    for a in range(0, t, rows):
        b = min(t, a + rows)
        seqs = [i for i in range(len(lengths)) if bounds[i] < b and bounds[i + 1] > a]  # rows in [a, b)
        piece_starts = [max(bounds[i], a) - a for i in seqs] + [b - a]
        piece_lens = [lengths[i] - (bounds[i + 1] - min(bounds[i + 1], b)) for i in seqs]  # rows after b: not yet
        yield (
            a,
            b,
            torch.tensor(piece_starts, dtype=torch.int32),
            torch.tensor(piece_lens, dtype=torch.int32),
            tables[seqs].contiguous(),
        )


def _check(rc: int, what: str) -> None:
    if rc == -1:
        raise MemoryError(f"{what} could not allocate its scratch memory")
    if rc == -2:
        raise ValueError(f"{what}: a sequence has more query rows than its length (inconsistent attention metadata)")


def native_step_for(model: Any) -> tuple[NativeStep | None, str]:
    """(the fused step for this `CausalLM`, "") or (None, why it cannot have one)."""
    if os.environ.get("HELEXA_CPU_STEP", "auto") == "torch":
        return None, "HELEXA_CPU_STEP=torch"
    if not native.available():
        return None, f"the native CPU kernel is unavailable ({native.unavailable_reason()})"
    if model.tp is not None:
        return None, "tensor parallelism"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return None, f"it runs float32 on the CPU (this model: {model.dtype} on {model.device})"
    head_dim = model.config.head_dim
    if head_dim % 8 or head_dim > _MAX_HEAD_DIM:
        return None, f"head_dim {head_dim} (it takes multiples of 8 up to {_MAX_HEAD_DIM})"
    if model.plan.num_heads > _MAX_GROUP * model.plan.num_kv_heads:
        return None, f"more than {_MAX_GROUP} query heads per KV head"
    keep: list[torch.Tensor] = []
    layers = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if attn.backend.name not in ("auto", "torch"):
            return None, f"attention backend {attn.backend.name!r} (it computes the reference backend's attention)"
        parts = {
            "qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj,
            "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj,
        }  # fmt: skip
        linears = {name: _linear(module, keep) for name, module in parts.items()}
        dense = [name for name, lin in linears.items() if lin is None]
        if dense:
            return None, f"layer {i}'s {', '.join(dense)} is not quantized for the native kernel"
        layers.append(
            _Layer(
                _norm_weight(layer.input_layernorm, keep),
                _norm_weight(layer.post_attention_layernorm, keep),
                _norm_weight(attn.q_norm, keep),
                _norm_weight(attn.k_norm, keep),
                linears["qkv_proj"],
                linears["o_proj"],
                linears["gate_up_proj"],
                linears["down_proj"],
            )  # fmt: skip
        )
    final_norm = _norm_weight(model.model.norm, keep)
    assert final_norm is not None
    return NativeStep(model, layers, keep, final_norm, _head(model, keep)), ""


def _head(model: Any, keep: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The output head as a function of final-normed rows (S, E) -> (S, V) float32 that computes each
    row on its own: the native quantized kernel where the head is quantized for it, else helexa's dense
    kernel (`native.dense_head`) over the float32 weight (dequantised once, if it is quantized for
    torch's kernels, whose order depends on the row count)."""
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    if isinstance(head, QuantEmbedding):
        head = head.head
    if isinstance(head, QuantLinear) and head.cpu_matmul is not None and head.cpu_matmul.kernel == "native":
        quantized = head
        return lambda rows: quantized(rows).float()
    weight = head.weight_q.dequantize(torch.float32) if isinstance(head, QuantLinear) else head.weight.detach().float()
    weight = weight.contiguous()
    keep.append(weight)
    return lambda rows: native.dense_head(rows.contiguous(), weight)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """The fused step's attention alone, with `helexa.kernels.reference.paged_attention`'s signature and
    result: q (T, H, D) float32, D % 8 == 0, over float32 or float16 caches (NB, BS, KVH, D) through
    block_tables (B, MB), seq_lens (B,) and query_start_loc (B + 1,), all int32 -> (T, H, D) float32."""
    t, h, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    if q.dtype != torch.float32 or not _cache_ok(k_cache, v_cache) or d % 8 or d > _MAX_HEAD_DIM or h % kvh:
        raise ValueError(
            "paged_attention takes float32 q (T, H, D), D % 8 == 0, and float32 or float16 caches (NB, BS, KVH, D)"
        )
    if h > _MAX_GROUP * kvh:
        raise ValueError(f"paged_attention takes at most {_MAX_GROUP} query heads per KV head")
    index = (block_tables, seq_lens, query_start_loc)
    if any(x.dtype != torch.int32 for x in index) or block_tables.stride(-1) != 1:
        raise ValueError(
            "block_tables, seq_lens and query_start_loc must be int32 (tables with a contiguous last dimension)"
        )
    b = block_tables.shape[0]
    if seq_lens.shape != (b,) or query_start_loc.shape != (b + 1,) or int(query_start_loc[-1]) != t:
        raise ValueError(f"{b} sequences need seq_lens ({b},) and query_start_loc ({b + 1},) ending at {t}")
    if b and int(seq_lens.max()) > block_tables.shape[1] * block_size:
        raise ValueError(f"a sequence of {int(seq_lens.max())} tokens needs more blocks than its table holds")
    q, lens, starts = q.contiguous(), seq_lens.contiguous(), query_start_loc.contiguous()
    out = torch.empty_like(q)
    rc = native.library().helexa_paged_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.stride()[:3], block_size, b, h, kvh, d,
        starts.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), lens.data_ptr(),
        d**-0.5 if scale is None else scale, k_cache.dtype == torch.float16, out.data_ptr(),
    )  # fmt: skip
    _check(rc, "paged_attention")
    return out
