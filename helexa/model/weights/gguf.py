"""GGUF import: turn a llama.cpp GGUF file into a Hugging Face style model directory.

`convert_gguf(gguf_path, out_dir)` writes, from the file's metadata and tensors alone:

    config.json             LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM
    model.safetensors       tensors under Hugging Face names, dequantised
    tokenizer.json          byte-level BPE built with `tokenizers` from the GGUF vocabulary
    tokenizer_config.json   chat template, special tokens, add_bos_token
    generation_config.json  bos / eos / pad ids

Weights are dequantised with `gguf.quants.dequantize` and stored as float32 by default: every
dequantised value of the supported types is exactly representable in float32, so the directory
holds precisely the numbers llama.cpp multiplies with, and the loader casts to whatever dtype it
runs in. `dtype="bfloat16"` halves the size at the cost of rounding those values.

llama.cpp stores the q/k projections of `llama` models permuted for its interleaved RoPE; this
module undoes that so Hugging Face's rotate-half RoPE gives the same result. `qwen2`/`qwen3` files
use llama.cpp's NeoX RoPE and are stored unpermuted, so they are copied as they are.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm.auto import tqdm

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "SUPPORTED_PRE_TOKENIZERS",
    "convert_gguf",
]

_Q = gguf.GGMLQuantizationType

# Types `gguf.quants.dequantize` turns into float32 that we accept.
SUPPORTED_TENSOR_TYPES: frozenset[str] = frozenset(
    {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
)


@dataclass(frozen=True)
class _Architecture:
    """How one GGUF `general.architecture` maps onto a Hugging Face model class."""

    hf_class: str
    model_type: str
    permuted_qk: bool  # llama.cpp permuted q/k rows for its interleaved (non-NeoX) RoPE
    attention_bias: bool  # q/k/v carry biases
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)


_ARCHITECTURES: dict[str, _Architecture] = {
    "llama": _Architecture("LlamaForCausalLM", "llama", permuted_qk=True, attention_bias=False, qk_norm=False),
    "qwen2": _Architecture("Qwen2ForCausalLM", "qwen2", permuted_qk=False, attention_bias=True, qk_norm=False),
    "qwen3": _Architecture("Qwen3ForCausalLM", "qwen3", permuted_qk=False, attention_bias=False, qk_norm=True),
}
SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset(_ARCHITECTURES)

# GGUF tensor name -> Hugging Face name; `{i}` is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

# Pre-tokenizer split patterns, keyed by `tokenizer.ggml.pre` (the names llama.cpp uses).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_FAMILY = ("default", "gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de")
_DIGITS_FAMILY = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
_LLAMA3_FAMILY = ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral")
_QWEN2_FAMILY = ("qwen2", "deepseek-r1-qwen")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre == pre`."""
    if pre in _GPT2_FAMILY:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    if pre in _DIGITS_FAMILY:  # every digit its own piece, then the GPT-2 split
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True),
            ]
        )
    split = _LLAMA3_SPLIT if pre in _LLAMA3_FAMILY else _QWEN2_SPLIT if pre in _QWEN2_FAMILY else None
    if split is None:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: {sorted(SUPPORTED_PRE_TOKENIZERS)}"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


SUPPORTED_PRE_TOKENIZERS: frozenset[str] = frozenset(_GPT2_FAMILY + _DIGITS_FAMILY + _LLAMA3_FAMILY + _QWEN2_FAMILY)

_TOKEN_CONTROL = 3  # gguf.TokenType.CONTROL
_TOKEN_USER_DEFINED = 4  # gguf.TokenType.USER_DEFINED


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    progress: bool = True,
    dtype: str = "float32",
    on_tensor: Callable[[str], None] | None = None,
) -> Path:
    """Convert the GGUF file at `gguf_path` into a Hugging Face style directory `out_dir`.

    Guarantees: on return `out_dir` holds config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json and generation_config.json, and `model.safetensors` has every tensor of
    the file under its Hugging Face name in `dtype` ("float32" or "bfloat16"), with llama q/k
    un-permuted. `out_dir` is created if missing; existing files with those names are overwritten
    (callers wanting atomicity convert into a fresh directory and rename it, as `pull` does).
    `on_tensor(gguf_name)` is called before each tensor is converted (a hook for tests).

    Raises ValueError naming what is supported for an unknown architecture, tensor type,
    tensor name, tokenizer model or pre-tokenizer, or a dtype other than float32/bfloat16.
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ValueError(f"GGUF file not found: {gguf_path}")
    reader = gguf.GGUFReader(gguf_path)
    meta = _Metadata(reader)
    arch_name = meta.get("general.architecture")
    if arch_name not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch_name!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    arch = _ARCHITECTURES[arch_name]
    _check_tensor_types(reader)

    config = _config(meta, arch_name, arch, {t.name for t in reader.tensors})
    tokenizer = _tokenizer(meta)
    tokenizer_config = _tokenizer_config(meta, config)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = _tensors(reader, config, arch, torch.float32 if dtype == "float32" else torch.bfloat16,
                       progress, on_tensor)
    config["torch_dtype"] = dtype
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "generation_config.json", _generation_config(meta, config))
    return out_dir


class _Metadata:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._fields = reader.fields

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        """The value under `key` (str, int, float, bool or list), or `default` if absent."""
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        """The value under `key`; a ValueError naming the key if the file lacks it."""
        if key not in self._fields:
            raise ValueError(f"GGUF metadata lacks required key {key!r}")
        return self._fields[key].contents()


def _check_tensor_types(reader: gguf.GGUFReader) -> None:
    bad = {t.name: t.tensor_type.name for t in reader.tensors if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES}
    if bad:
        name, kind = next(iter(bad.items()))
        raise ValueError(
            f"unsupported GGUF tensor type {kind} (tensor {name!r} and {len(bad) - 1} more); "
            f"supported: {', '.join(sorted(SUPPORTED_TENSOR_TYPES))}"
        )


def _config(meta: _Metadata, arch_name: str, arch: _Architecture, tensor_names: set[str]) -> dict[str, Any]:
    """config.json contents from the `<arch>.*` metadata keys."""
    def key(suffix: str) -> str:
        return f"{arch_name}.{suffix}"

    hidden = int(meta.require(key("embedding_length")))
    heads = int(meta.require(key("attention.head_count")))
    kv_heads = int(meta.get(key("attention.head_count_kv"), heads))
    head_dim = int(meta.get(key("attention.key_length"), hidden // heads))
    tokens = meta.require("tokenizer.ggml.tokens")
    vocab_size = int(meta.get(key("vocab_size"), len(tokens)))
    rope_theta = float(meta.get(key("rope.freq_base"), 10000.0))
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF carries rope_freqs.weight (llama3-style RoPE scaling), which is not supported")
    rope_scaling = _rope_scaling(meta, key)

    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(key("feed_forward_length"))),
        "num_hidden_layers": int(meta.require(key("block_count"))),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get(key("context_length"), 2048)),
        "rms_norm_eps": float(meta.get(key("attention.layer_norm_rms_epsilon"), 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})},
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if arch.model_type == "llama":
        config["attention_bias"] = any(n.endswith("attn_q.bias") for n in tensor_names)
        config["mlp_bias"] = False
    elif arch.model_type in ("qwen2", "qwen3"):
        config["attention_bias"] = arch.attention_bias
        config["use_sliding_window"] = False
        config["sliding_window"] = None
        config["max_window_layers"] = config["num_hidden_layers"]
    if config["head_dim"] * heads != hidden and arch.model_type == "qwen2":
        raise ValueError(f"qwen2 requires head_dim * heads == hidden_size, got {head_dim} * {heads} != {hidden}")
    return config


def _rope_scaling(meta: _Metadata, key: Callable[[str], str]) -> dict[str, Any] | None:
    kind = meta.get(key("rope.scaling.type"))
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta.require(key("rope.scaling.factor")))}
    raise ValueError(f"unsupported GGUF RoPE scaling type {kind!r}; supported: none, linear")


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(
        f"unexpected GGUF tensor {gguf_name!r}; known: {sorted(_GLOBAL_NAMES)} and blk.N.{{{', '.join(_LAYER_NAMES)}}}"
    )


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp (for interleaved RoPE) reorders each head's rows from `[first half, second half]`
    to pairs `(r, r + d/2)` side by side: `w.reshape(h, 2, d/2, ...).swapaxes(1, 2)`. Inverting it
    restores the half-split layout Hugging Face's `rotate_half` expects. `w`: `[h * d, ...]`.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(
    reader: gguf.GGUFReader,
    config: dict[str, Any],
    arch: _Architecture,
    dtype: torch.dtype,
    progress: bool,
    on_tensor: Callable[[str], None] | None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantised, renamed and un-permuted, as contiguous `dtype`."""
    out: dict[str, torch.Tensor] = {}
    bar = tqdm(reader.tensors, desc="converting GGUF", unit="tensor", disable=not progress)
    for t in bar:
        if on_tensor is not None:
            on_tensor(t.name)
        name = _hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)  # float32
        if arch.permuted_qk and ".attn_q." in t.name:
            w = _unpermute(w, config["num_attention_heads"])
        elif arch.permuted_qk and ".attn_k." in t.name:
            w = _unpermute(w, config["num_key_value_heads"])
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C")).to(dtype)  # own, writable copy
    return out


def _tokenizer(meta: _Metadata) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` equal to llama.cpp's for this vocabulary."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r}; supported: 'gpt2' (byte-level BPE)")
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = []
    for merge in meta.require("tokenizer.ggml.merges"):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"malformed GGUF merge {merge!r}: expected two tokens separated by one space")
        merges.append((parts[0], parts[1]))
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"GGUF vocabulary has duplicate tokens ({len(tokens) - len(vocab)} duplicates)")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _TOKEN_CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _TOKEN_USER_DEFINED]
    )
    tok.post_processor = _post_processor(meta, tokens)
    return tok


def _post_processor(meta: _Metadata, tokens: list[str]) -> processors.PostProcessor:
    """Byte-level offsets, plus BOS/EOS insertion when the metadata asks for it."""
    steps: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)]
    bos = _special(meta, tokens, "bos") if meta.get("tokenizer.ggml.add_bos_token", False) else None
    eos = _special(meta, tokens, "eos") if meta.get("tokenizer.ggml.add_eos_token", False) else None
    if bos is not None or eos is not None:
        head = [f"{bos[0]}:0"] if bos else []
        tail = [f"{eos[0]}:0"] if eos else []
        steps.append(
            processors.TemplateProcessing(
                single=" ".join(head + ["$A:0"] + tail),
                pair=" ".join(head + ["$A:0"] + tail + head + ["$B:1"] + tail),
                special_tokens=[s for s in (bos, eos) if s is not None],
            )
        )
    return processors.Sequence(steps)


def _special(meta: _Metadata, tokens: list[str], kind: str) -> tuple[str, int] | None:
    key = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}[kind]
    token_id = meta.get(f"tokenizer.ggml.{key}")
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise ValueError(f"GGUF {kind} token id {token_id} outside the vocabulary of {len(tokens)}")
    return tokens[token_id], int(token_id)


def _tokenizer_config(meta: _Metadata, config: dict[str, Any]) -> dict[str, Any]:
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    for kind in ("bos", "eos", "unk", "pad"):
        special = _special(meta, tokens, kind)
        out[f"{kind}_token"] = special[0] if special else None
    out["added_tokens_decoder"] = {
        str(i): {
            "content": t,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": k == _TOKEN_CONTROL,
        }
        for i, (t, k) in enumerate(zip(tokens, types))
        if k in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        out["chat_template"] = template
    return out


def _generation_config(meta: _Metadata, config: dict[str, Any]) -> dict[str, Any]:
    """bos/eos/pad ids; eos becomes a list when the file names a distinct end-of-turn token."""
    out = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and out.get("eos_token_id") not in (None, eot):
        out["eos_token_id"] = [out["eos_token_id"], int(eot)]
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
