"""GGUF test support: synthetic GGUF files written from tiny random Hugging Face models (llama.cpp's
tensor names, q/k permutation and tokenizer metadata), to check the import against what they came from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.support.models import TINY_ARCHS, tiny_hf_config

Q = gguf.GGMLQuantizationType

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, hello again; the world says hello back.",
    "Tokenizers split text into pieces: words, spaces and punctuation.",
    "café naïve résumé — unicode survives byte-level BPE 🤗",
    "def add(a, b):\n    return a + b\n",
    "In 2024 and 2025 and 2024 again, 2024.",
] * 4
SAMPLES = [
    "Hello world!",
    "the lazy fox, again",
    "  two spaces\tand tab\n",
    "naïve 🤗 x=12345",
    "<|im_start|>hi<|im_end|>",
]


def train_tiny_bpe() -> Tokenizer:
    """A byte-level BPE (GPT-2 split) trained on a few sentences, with three special tokens first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation for interleaved RoPE (what its converter writes)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_LAYER_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_HF_LAYER_TO_GGUF[rest]}"


def tiny_hf_model(arch: str, vocab_size: int, tie: bool, seed: int = 0) -> Any:
    """A tiny random transformers model (no download), weights spread wider than the default init."""
    import transformers

    head_dim = 32 if arch == "qwen3" else 16  # qwen3: head_dim != hidden/heads on purpose
    overrides = dict(rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=tie, pad_token_id=2)
    config = tiny_hf_config(arch, vocab_size=vocab_size, head_dim=head_dim, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, TINY_ARCHS[arch][1])(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def write_gguf(
    path: Path,
    arch: str,
    config: dict[str, Any],
    tensors: dict[str, np.ndarray],
    qtype: Q = Q.F32,
    tokenizer: Tokenizer | None = None,
    pre: str = "gpt-2",
    add_bos: bool = False,
    tokenizer_model: str = "gpt2",
    raw: dict[str, tuple[np.ndarray, Q]] | None = None,
) -> Path:
    """Write a GGUF as llama.cpp's converter would: metadata, vocabulary, q/k permuted for llama.

    `tensors` are in Hugging Face names and layout; 2-D ones are stored as `qtype`, 1-D as F32.
    `raw` adds tensors already in GGUF form: `{gguf_name: (uint8 blocks, type)}`.
    """
    tokenizer = tokenizer or train_tiny_bpe()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_dimension_count(config["head_dim"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]]
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    for hf_name, arr in tensors.items():
        name = gguf_name(hf_name)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            arr = llama_cpp_permute(arr, config["num_attention_heads"])
        elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            arr = llama_cpp_permute(arr, config["num_key_value_heads"])
        if arr.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, arr)
        elif qtype == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    for name, (blocks, kind) in (raw or {}).items():
        w.add_tensor(name, blocks, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_config_dict(model: Any) -> dict[str, Any]:
    c = model.config
    rope = getattr(c, "rope_parameters", None) or {}
    return {
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rope_theta": rope.get("rope_theta", getattr(c, "rope_theta", None)),
        "rms_norm_eps": c.rms_norm_eps,
    }


def write_tiny_gguf(
    path: Path, arch: str = "llama", qtype: Q = Q.F32, tie: bool = False, **kw: Any
) -> tuple[Path, Any]:
    """A GGUF of a tiny random `arch` model; returns (path, the transformers model it came from)."""
    tokenizer = kw.pop("tokenizer", None) or train_tiny_bpe()
    model = tiny_hf_model(arch, tokenizer.get_vocab_size(), tie)
    tensors = {k: v.detach().numpy() for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    write_gguf(path, arch, hf_config_dict(model), tensors, qtype=qtype, tokenizer=tokenizer, **kw)
    return path, model
