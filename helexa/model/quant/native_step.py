"""The fused CPU step (`csrc/step.c`): a quantized model's whole forward in one native call, token ids
to the sampled rows' logits (the embedding lookup, every layer, the final norm and the head), for every
step: decode, prefill, a chunk of a chunked prefill, an extend after a prefix-cache hit, or any mix. Rows
that want only their argmax (greedy ones) get their token instead: the head is folded into each row's
argmax a block of columns at a time, and their logits are never stored.

Two reasons it serves every step. Speed: on a CPU, a step of a small model is dominated not by its
matmuls but by the few dozen torch operations around them in every layer (norms, RoPE, the cache
write, attention, activations), each a dispatch of ~10 µs. Determinism: a token's logits and K/V
must not depend on what else shares the step or how its sequence was split into steps; the C step
computes each row by the same operations in the same order whatever the batch (per-row projections,
norms and activations, RoPE from the row's own position, attention split at fixed key positions and
merged in a fixed order; csrc/step.c says how), so one computation per row and per position is the
whole guarantee. It computes what `CausalLM`'s torch layers compute with the reference attention
backend, in float32, through the same quantized kernel (`native`), writing K/V into the same paged
caches through the same block tables. The lookup and the head are in the call too: after a step has
streamed its weights through the caches, each torch operation around it costs 10-40 us more than it
does warm (the default model's lookup, row gather and head wrapper took ~250 us a step in Python, now
~30 us for the whole call's Python side).

`native_step_for(model)` decides once, at load, whether a model can use it and says why not: CPU,
float32, no tensor parallelism, the reference attention backend, every decoder projection quantized
for the native kernel, head_dim a multiple of 8 up to 512, at most 16 query heads per KV head. Each
step still checks what varies (float32 or float16 caches with a contiguous last dimension, index dtypes); a step
that does not fit (an fp8 cache) takes the torch layers. `HELEXA_CPU_STEP=torch` turns it off.
"""

from __future__ import annotations

import ctypes
import operator
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from helexa.kvcache.metadata import AttentionMetadata
from helexa.model.buffers import KeptBuffers
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
# A caller that reads each step's logits before the next (`reuse_logits`) gets them in one buffer the step
# keeps, up to this size: fresh logits of 16 rows of a 49k vocabulary (3 MiB) are new pages every step,
# faulted in as the head writes them, which took ~0.8 ms of a ~15 ms 16-stream step of the default model.
REUSED_LOGITS_BYTES = 32 << 20
# Rows that want only their argmax (`argmax_indices`) go through the head this many bytes of logits at a time
# (csrc/step.c's head_argmax: each block's argmax folded into the row's answer), so their logits never exist
# whole: a step verifying 48 greedy drafted rows of a 49k vocabulary held 9 MiB of logits to take 48 indices.
ARGMAX_BLOCK_BYTES = 1 << 20


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


class _Table(ctypes.Structure):  # a (rows, E) vocabulary table: tiled and quantized (q), float32 (dense), or none
    _fields_ = [("q", _Linear), ("dense", _p), ("rows", _i64)]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
        ("intermediate", _i64), ("block_size", _i64), ("eps", ctypes.c_double), ("final_norm", _p),
        ("layers", ctypes.POINTER(_Layer)), ("embed", _Table), ("head", _Table),
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
    """A model's forward as one native call per step (build it with `native_step_for`): token ids to the
    sampled rows' logits, the embedding lookup, every decoder layer, the final norm and the output head
    in C. Holds its own float32 copies of the norm weights and biases; the projections' and tables'
    tiled weights are the ones their `CpuQuantMatmul` prepared."""

    def __init__(
        self,
        model: Any,
        layers: list[_Layer],
        keep: list[torch.Tensor],
        final_norm: int,
        tables: tuple[_Table, _Table],
        embed: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> None:
        config, plan = model.config, model.plan
        self._keep = keep  # everything the C structures point to
        # token ids (R,) -> embeddings (R, E) float32, looked up here per piece: only for an embedding
        # table the C side cannot read (then `tables[0]` is empty)
        self._embed = embed
        self._layers = (_Layer * len(layers))(*layers)
        self._model = _Model(
            len(layers), config.hidden_size, plan.num_heads, plan.num_kv_heads, config.head_dim,
            plan.intermediate_size, 0, config.rms_norm_eps, final_norm, self._layers, *tables,
        )  # fmt: skip
        self._model_arg = ctypes.byref(self._model)
        self._vocab = tables[1].rows  # the logits' columns
        self._inv_freq = model.inv_freq.detach().float().cpu().contiguous()  # (D/2,) RoPE frequencies
        self._bound: tuple[Any, ...] = ()  # the (k, v) pairs the layers point to
        self._kept = KeptBuffers()  # the logits of a caller that reuses them (`reuse_logits`)
        native.library()  # built and loaded now: the first step pays nothing

    def _bind_caches(self, kv_caches: Sequence[Any]) -> bool:
        """Point the layers at these caches (once per pool: the pairs it was last given, compared by
        identity; a pool never re-points its tensors); False when a cache does not fit."""
        if len(kv_caches) == len(self._bound) and all(map(operator.is_, kv_caches, self._bound)):
            return True
        if len(kv_caches) != len(self._layers) or not all(_cache_ok(*pair) for pair in kv_caches):
            return False
        for layer, (k, v) in zip(self._layers, kv_caches):
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
            layer.block_stride, layer.row_stride, layer.head_stride = k.stride(0), k.stride(1), k.stride(2)
            layer.kv_half = k.dtype == torch.float16
        self._model.block_size = kv_caches[0][0].shape[1]
        self._bound = tuple(kv_caches)
        return True

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: Sequence[Any],
        logits_indices: torch.Tensor,
        reuse_logits: bool = False,
        argmax_indices: torch.Tensor | None = None,
        argmax_cols: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits (S, V) float32 of one step's rows `logits_indices` (S,), tokens (A,) int64 of its rows
        `argmax_indices` (A,)): input_ids (T,) the new tokens, positions (T,) int64 theirs, `attn` the step's
        metadata; the new K/V are written to the caches. A token is the index `argmax` gives of its row's logits
        over columns [0, `argmax_cols`) (default V), whose logits are never stored (`ARGMAX_BLOCK_BYTES` at a time).
        A step of more than `STEP_ROWS` rows runs as consecutive calls of at most that many, each embedding
        its own rows (a long prefill holds one piece's activations, not the whole chunk's). None, with
        nothing written, when the step or the caches do not fit (then the caller runs the torch layers).
        `reuse_logits`: the caller is done with these logits before its next call, so they may be rows of
        a buffer the step keeps and the next call overwrites (up to `REUSED_LOGITS_BYTES`; else fresh)."""
        t = input_ids.shape[0]
        if attn.num_tokens != t or positions.shape != (t,) or t == 0:
            return None
        tables, lens, slots, starts = attn.block_tables, attn.seq_lens, attn.slot_mapping, attn.query_start_loc
        if any(x.dtype != torch.int32 for x in (tables, lens, starts)) or slots.dtype != torch.int64:
            return None
        if tables.stride(-1) != 1 or not self._bind_caches(kv_caches):
            return None
        argmax = torch.empty(0, dtype=torch.int64) if argmax_indices is None else argmax_indices
        cols = self._vocab if argmax_cols is None else argmax_cols
        if argmax.numel() and not 0 < cols <= self._vocab:
            raise ValueError(f"argmax_cols must be in [1, {self._vocab}], got {cols}")
        ids, positions, rows, arg_rows = (v.long().contiguous() for v in (input_ids, positions, logits_indices, argmax))
        lens, slots, starts = lens.contiguous(), slots.contiguous(), starts.contiguous()
        logits = self._logits_for(rows.shape[0], reuse_logits)  # (S, V)
        tokens = torch.empty(arg_rows.shape[0], dtype=torch.int64)  # (A,)
        if t <= STEP_ROWS:
            self._forward(ids, positions, slots, starts, lens, tables, rows, logits, arg_rows, cols, tokens)
            return logits, tokens
        for a, b, piece_starts, piece_lens, piece_tables in _pieces(starts, lens, tables, t, STEP_ROWS):
            here, arg_here = ((r >= a) & (r < b) for r in (rows, arg_rows))  # the rows this piece samples
            part = torch.empty(int(here.sum()), self._vocab)
            part_tokens = torch.empty(int(arg_here.sum()), dtype=torch.int64)
            self._forward(ids[a:b], positions[a:b], slots[a:b], piece_starts, piece_lens, piece_tables,
                          rows[here] - a, part, arg_rows[arg_here] - a, cols, part_tokens)  # fmt: skip
            logits[here], tokens[arg_here] = part, part_tokens
        return logits, tokens

    def _logits_for(self, s: int, reuse: bool) -> torch.Tensor:
        """(s, V) float32 for a step's logits: the kept buffer's rows when `reuse` (up to `REUSED_LOGITS_BYTES`),
        else a tensor of their own."""
        if not reuse:
            return torch.empty(s, self._vocab)
        return self._kept.get("logits", s, self._vocab, REUSED_LOGITS_BYTES)

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        starts: torch.Tensor,
        lens: torch.Tensor,
        tables: torch.Tensor,
        rows: torch.Tensor,
        logits: torch.Tensor,
        arg_rows: torch.Tensor,
        arg_cols: int,
        tokens: torch.Tensor,
    ) -> None:
        """One native call over the rows of `ids` (each argument contiguous, as `__call__` made them)."""
        x = None
        if self._embed is not None:  # a table the C side cannot read: looked up here, only read there
            x = self._embed(ids)
            if x.dtype != torch.float32:
                raise TypeError(f"the fused step runs float32 embeddings, got {x.dtype}")
            x = x.contiguous()
        block = ARGMAX_BLOCK_BYTES // (4 * max(1, arg_rows.shape[0]))  # columns a block (C rounds to its tiles)
        rc = native.library().helexa_forward(
            self._model_arg, ids.shape[0], ids.data_ptr(), None if x is None else x.data_ptr(), positions.data_ptr(),
            self._inv_freq.data_ptr(), slots.data_ptr(), lens.shape[0], starts.data_ptr(), tables.data_ptr(),
            tables.stride(0), lens.data_ptr(), rows.shape[0], rows.data_ptr(), logits.data_ptr(),
            arg_rows.shape[0], arg_rows.data_ptr(), arg_cols, block, tokens.data_ptr(),
        )  # fmt: skip
        if rc == -3:
            bad = ids[(ids < 0) | (ids >= self._model.embed.rows)][0].item()
            raise IndexError(f"token id {bad} is out of range for an embedding of {self._model.embed.rows} rows")
        _check(rc, "the native step")


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
        raise ValueError(
            f"{what}: a sequence has more query rows than its length, or a sampled row is outside the step"
            " (inconsistent metadata)"
        )


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
    embed = _table(model.model.embed_tokens, keep)
    caller_embeds = None if embed is not None else model.model.embed_tokens
    tables = (embed if embed is not None else _Table(), _head(model, keep))
    return NativeStep(model, layers, keep, final_norm, tables, caller_embeds), ""


def _table(module: Any, keep: list[torch.Tensor]) -> _Table | None:
    """The C view of an embedding table: the native kernel's tiled weight of a `QuantEmbedding` (its head's),
    or a float32 `nn.Embedding`'s weight; None for any other (the step then takes embeddings from Python)."""
    if isinstance(module, QuantEmbedding):
        q = _linear(module.head, keep)
        return None if q is None else _Table(q, None, q.n)
    if isinstance(module, nn.Embedding) and module.weight.dtype == torch.float32 and not module.weight.is_cuda:
        weight = module.weight.detach().contiguous()
        keep.append(weight)
        return _Table(_Linear(), weight.data_ptr(), weight.shape[0])
    return None


def _head(model: Any, keep: list[torch.Tensor]) -> _Table:
    """The output head as the C step's table, computing each row on its own: the native quantized kernel's
    tiled weight where the head is quantized for it, else a float32 weight for helexa's dense head
    (dequantised once, if it is quantized for torch's kernels, whose order depends on the row count)."""
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    if isinstance(head, QuantEmbedding):
        head = head.head
    if isinstance(head, QuantLinear):
        q = _linear(head, keep)
        if q is not None:
            return _Table(q, None, q.n)
    weight = head.weight_q.dequantize(torch.float32) if isinstance(head, QuantLinear) else head.weight.detach().float()
    weight = weight.contiguous()
    keep.append(weight)
    return _Table(_Linear(), weight.data_ptr(), weight.shape[0])


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
