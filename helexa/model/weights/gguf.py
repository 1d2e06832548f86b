"""GGUF import: a llama.cpp GGUF file into a Hugging Face style directory (config, safetensors,
byte-level BPE tokenizer.json, tokenizer and generation configs), from the file alone. Q4_0, Q4_1 and
Q8_0 weights stay quantized (exactly; `gguf_quant`); other types are dequantised, exactly in float32
(the default): the numbers llama.cpp multiplies with. The q/k
rows llama.cpp permutes for its interleaved RoPE (`llama`) are un-permuted for rotate-half RoPE.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm.auto import tqdm

from helexa.model.text.tokenizer import bos_eos_processor
from helexa.model.weights.gguf_quant import KEPT_QUANTIZED, read_quantized

if TYPE_CHECKING:
    import gguf

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_TENSOR_TYPES", "SUPPORTED_PRE_TOKENIZERS", "convert_gguf"]

# Types `gguf.quants.dequantize` turns into float32 that we accept.
SUPPORTED_TENSOR_TYPES: frozenset[str] = frozenset(
    {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
)


class _Arch(NamedTuple):
    """How one GGUF `general.architecture` maps onto a Hugging Face model class."""

    hf_class: str
    permuted_qk: bool  # llama.cpp permuted q/k rows for its interleaved (non-NeoX) RoPE
    attention_bias: bool | None  # q/k/v carry biases; None: whether the file has them


_ARCHITECTURES = {
    "llama": _Arch("LlamaForCausalLM", permuted_qk=True, attention_bias=None),
    "qwen2": _Arch("Qwen2ForCausalLM", permuted_qk=False, attention_bias=True),
    "qwen3": _Arch("Qwen3ForCausalLM", permuted_qk=False, attention_bias=False),
}
SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset(_ARCHITECTURES)

# GGUF tensor name -> Hugging Face name; `_LAYER_NAMES` maps what follows `blk.N.` in layer N.
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
    split = _LLAMA3_SPLIT if pre in _LLAMA3_FAMILY else _QWEN2_SPLIT if pre in _QWEN2_FAMILY else None
    if split is None and pre not in _GPT2_FAMILY + _DIGITS_FAMILY:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: {sorted(SUPPORTED_PRE_TOKENIZERS)}"
        )
    # Without a split of its own, ByteLevel applies the GPT-2 split.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=split is None)
    if split is not None:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    if pre in _DIGITS_FAMILY:  # every digit its own piece, then the GPT-2 split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


SUPPORTED_PRE_TOKENIZERS: frozenset[str] = frozenset(_GPT2_FAMILY + _DIGITS_FAMILY + _LLAMA3_FAMILY + _QWEN2_FAMILY)

_TOKEN_CONTROL = 3  # gguf.TokenType.CONTROL
_TOKEN_USER_DEFINED = 4  # gguf.TokenType.USER_DEFINED


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    progress: bool = True,
    dtype: str = "float32",
    on_tensor: Callable[[str], None] | None = None,
    keep_quantized: bool = True,
) -> Path:
    """Convert the GGUF file at `gguf_path` into the directory `out_dir` (created or overwritten), every
    tensor under its Hugging Face name in `dtype` ("float32" or "bfloat16"); `on_tensor(gguf_name)` is
    called before each. With `keep_quantized`, Q4_0/Q4_1/Q8_0 weights are written as they are instead
    (`X.qweight`, `X.scales`, `X.zeros` for module `X`; see `gguf_quant`), other types dequantised.
    ValueError names what is supported for an unknown architecture, tensor type, tensor name,
    tokenizer model or pre-tokenizer, or another dtype."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ValueError(f"GGUF file not found: {gguf_path}")
    import gguf  # the reader (and the PyYAML it brings) loads only when a GGUF is converted, not in every engine

    try:
        reader = gguf.GGUFReader(gguf_path)
    except (ValueError, IndexError, EOFError) as exc:  # bad magic, truncated or malformed header
        raise ValueError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc
    meta = _Metadata(reader)
    arch_name = meta.get("general.architecture")
    if arch_name not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch_name!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    bad = {t.name: t.tensor_type.name for t in reader.tensors if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES}
    if bad:
        name, kind = next(iter(bad.items()))
        raise ValueError(
            f"unsupported GGUF tensor type {kind} (tensor {name!r} and {len(bad) - 1} more); "
            f"supported: {', '.join(sorted(SUPPORTED_TENSOR_TYPES))}"
        )
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    config = _config(meta, arch_name, len(tokens), {t.name for t in reader.tensors})
    tokenizer = _tokenizer(meta, tokens, types)
    tokenizer_config = _tokenizer_config(meta, config, tokens, types)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    heads = {".attn_q.": config["num_attention_heads"], ".attn_k.": config["num_key_value_heads"]}
    tensors: dict[str, torch.Tensor] = {}
    kept: dict[str, int] = {}  # GGUF type -> tensors written quantized
    for t in tqdm(reader.tensors, desc="converting GGUF", unit="tensor", disable=not progress):
        if on_tensor is not None:
            on_tensor(t.name)
        name = _hf_name(t.name)
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims fastest-first
        n_heads = next((n for part, n in heads.items() if part in t.name), None)
        unpermute = n_heads is not None and _ARCHITECTURES[arch_name].permuted_qk
        kind = t.tensor_type.name
        if keep_quantized and kind in KEPT_QUANTIZED and len(shape) == 2 and name.endswith(".weight"):
            kept[kind] = kept.get(kind, 0) + 1
            module = name.removesuffix(".weight")
            for suffix, part in read_quantized(t.data, kind, (shape[0], shape[1])).items():
                part = _unpermute(part, n_heads) if unpermute and n_heads else part  # rows, like the weight's
                tensors[f"{module}.{suffix}"] = torch.from_numpy(np.ascontiguousarray(part))
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)  # float32
        if unpermute and n_heads:
            w = _unpermute(w, n_heads)
        w = np.array(w, dtype=np.float32, order="C")  # an own, writable, contiguous copy
        tensors[name] = torch.from_numpy(w).to(torch.float32 if dtype == "float32" else torch.bfloat16)
    config["torch_dtype"] = dtype
    if kept:  # informational: the loader reads the layout from the tensors themselves
        config["quantization_config"] = {"quant_method": "gguf", "kept_quantized": kept, "group_size": 32}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    for name, obj in [
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", _generation_config(meta, config)),
    ]:
        (out_dir / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out_dir


class _Metadata:
    """A GGUF file's key/value metadata, each value (str, int, float, bool or list) read on demand."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        return default if key not in self._fields else self._fields[key].contents()

    def require(self, key: str) -> Any:  # a ValueError naming `key` if the file lacks it
        if key not in self._fields:
            raise ValueError(f"GGUF metadata lacks required key {key!r}")
        return self.get(key)


def _config(meta: _Metadata, arch_name: str, num_tokens: int, tensor_names: set[str]) -> dict[str, Any]:
    """config.json contents from the `<arch>.*` metadata keys."""
    arch = _ARCHITECTURES[arch_name]

    def key(suffix: str) -> str:
        return f"{arch_name}.{suffix}"

    hidden = int(meta.require(key("embedding_length")))
    heads = int(meta.require(key("attention.head_count")))
    head_dim = int(meta.get(key("attention.key_length"), hidden // heads))
    if arch_name == "qwen2" and head_dim * heads != hidden:
        raise ValueError(f"qwen2 requires head_dim * heads == hidden_size, got {head_dim} * {heads} != {hidden}")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF carries rope_freqs.weight (llama3-style RoPE scaling), which is not supported")
    rope_theta = float(meta.get(key("rope.freq_base"), 10000.0))
    scaling_type = meta.get(key("rope.scaling.type"))
    if scaling_type not in (None, "none", "linear"):
        raise ValueError(f"unsupported GGUF RoPE scaling type {scaling_type!r}; supported: none, linear")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta.require(key("rope.scaling.factor")))}
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch_name,
        "vocab_size": int(meta.get(key("vocab_size"), num_tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(key("feed_forward_length"))),
        "num_hidden_layers": int(meta.require(key("block_count"))),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(key("attention.head_count_kv"), heads)),
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
    if arch.attention_bias is None:  # llama
        config.update(attention_bias=any(n.endswith("attn_q.bias") for n in tensor_names), mlp_bias=False)
    else:
        config.update(attention_bias=arch.attention_bias, use_sliding_window=False, sliding_window=None)
        config["max_window_layers"] = config["num_hidden_layers"]
    return config


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
    """Undo llama.cpp's q/k row permutation of `w`: `[h * d, ...]`: it interleaves each head's two row
    halves into pairs `(r, r + d/2)` (`w.reshape(h, 2, d/2, ...).swapaxes(1, 2)`)."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(meta: _Metadata, tokens: list[str], types: list[int]) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` equal to llama.cpp's for this vocabulary."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r}; supported: 'gpt2' (byte-level BPE)")
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
    for kind, add in ((_TOKEN_CONTROL, tok.add_special_tokens), (_TOKEN_USER_DEFINED, tok.add_tokens)):
        add([AddedToken(t, special=k == _TOKEN_CONTROL, normalized=False) for t, k in zip(tokens, types) if k == kind])
    # Byte-level offsets, then BOS/EOS where the metadata asks for them.
    bos = _special(meta, tokens, "bos") if meta.get("tokenizer.ggml.add_bos_token", False) else None
    eos = _special(meta, tokens, "eos") if meta.get("tokenizer.ggml.add_eos_token", False) else None
    add_specials = [bos_eos_processor(bos, eos)] if bos or eos else []
    tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), *add_specials])
    return tok


def _special(meta: _Metadata, tokens: list[str], kind: str) -> tuple[str, int] | None:
    key = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}[kind]
    token_id = meta.get(f"tokenizer.ggml.{key}")
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise ValueError(f"GGUF {kind} token id {token_id} outside the vocabulary of {len(tokens)}")
    return tokens[token_id], int(token_id)


def _tokenizer_config(meta: _Metadata, config: dict[str, Any], tokens: list[str], types: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    for kind in ("bos", "eos", "unk", "pad"):
        out[f"{kind}_token"] = (_special(meta, tokens, kind) or (None,))[0]
    flags = dict.fromkeys(("lstrip", "rstrip", "normalized", "single_word"), False)
    out["added_tokens_decoder"] = {
        str(i): {"content": t, **flags, "special": k == _TOKEN_CONTROL}
        for i, (t, k) in enumerate(zip(tokens, types))
        if k in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        out["chat_template"] = template
    return out


# GGUF `general.sampling.*` metadata (the author's recommended sampling) -> generation_config keys.
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
}


def _generation_config(meta: _Metadata, config: dict[str, Any]) -> dict[str, Any]:
    """bos/eos/pad ids; eos becomes a list when the file names a distinct end-of-turn token; the
    recommended sampling (`temperature`, `top_k`, `top_p`, `min_p`) where the file carries it."""
    out: dict[str, Any] = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None
    }
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and out.get("eos_token_id") not in (None, eot):
        out["eos_token_id"] = [out["eos_token_id"], int(eot)]
    for key, name in _SAMPLING_KEYS.items():
        value = meta.get(key)
        if name == "top_k" and value is not None:
            out[name] = int(value)
        elif value is not None:  # stored as float32: 0.2 reads back as 0.20000000298...
            out[name] = round(float(value), 6)
    return out
