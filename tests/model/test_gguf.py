"""GGUF import: synthetic GGUF files written from tiny random Hugging Face models, converted back.

The oracle is the model the GGUF was written from: tensors must come back exactly (F32) or
within the quantisation error of their type, with llama's q/k permutation undone, and
transformers running the converted directory must give the original model's logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from helexa.model.weights.gguf import SUPPORTED_TENSOR_TYPES, convert_gguf
from tests.model.tiny import TINY_ARCHS, tiny_hf_config

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


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_tiny_bpe()


def _quant_bound(ref: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Per-element bound on |dequant(quant(ref)) - ref| for the 32-wide block types, with slack."""
    blocks = ref.reshape(-1, 32)  # (n_blocks, 32)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    span = blocks.amax(dim=1, keepdim=True) - blocks.amin(dim=1, keepdim=True)
    step = {Q.Q8_0: amax / 127, Q.Q4_0: amax / 8, Q.Q4_1: span / 15}[qtype]
    return (step + 1e-3 * amax + 1e-7).expand_as(blocks).reshape(ref.shape)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_llama_tensors_round_trip(tmp_path: Path, bpe: Tokenizer, qtype: Q) -> None:
    path, model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", qtype, tokenizer=bpe)
    out = convert_gguf(path, tmp_path / "hf", progress=False)
    got = load_file(str(out / "model.safetensors"))
    want = model.state_dict()
    assert set(got) == set(want)
    for name, ref in want.items():
        ref = ref.float()
        assert got[name].dtype == torch.float32 and got[name].shape == ref.shape, name
        if qtype == Q.F32 or ref.ndim == 1:
            torch.testing.assert_close(got[name], ref, rtol=0, atol=0, msg=name)
        elif qtype == Q.F16:
            torch.testing.assert_close(got[name], ref.half().float(), rtol=0, atol=0, msg=name)
        elif qtype == Q.BF16:
            torch.testing.assert_close(got[name], ref.bfloat16().float(), rtol=2**-8, atol=0, msg=name)
        else:
            err = (got[name] - ref).abs()
            bound = _quant_bound(ref, qtype)
            assert bool((err <= bound).all()), f"{name}: max excess {(err - bound).max().item():.3g}"
            assert err.max().item() > 0  # it really was quantised


@pytest.mark.parametrize("arch, tie", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_config_and_logits_round_trip(tmp_path: Path, bpe: Tokenizer, arch: str, tie: bool) -> None:
    import transformers

    path, model = write_tiny_gguf(tmp_path / "tiny.gguf", arch, Q.F32, tie=tie, tokenizer=bpe)
    out = convert_gguf(path, tmp_path / "hf", progress=False)
    config = json.loads((out / "config.json").read_text())
    want = model.config
    assert config["architectures"] == [type(model).__name__]
    assert config["model_type"] == want.model_type
    assert config["tie_word_embeddings"] is tie
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        assert config[key] == getattr(want, key), key
    assert config["rope_theta"] == pytest.approx(hf_config_dict(model)["rope_theta"])
    assert config["rms_norm_eps"] == pytest.approx(want.rms_norm_eps, rel=1e-6)
    assert ("lm_head.weight" in load_file(str(out / "model.safetensors"))) is not tie

    # Same logits from the converted directory: the permutation (llama) or its absence (qwen) is right.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(loaded) is type(model)
    ids = torch.randint(3, config["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_tokenizer_files(tmp_path: Path, bpe: Tokenizer) -> None:
    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", Q.F32, tokenizer=bpe)
    out = convert_gguf(path, tmp_path / "hf", progress=False)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in SAMPLES:
        assert tok.encode(text).ids == bpe.encode(text).ids, text
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>").ids == [1]  # specials stay whole
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["unk_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert cfg["add_bos_token"] is False
    assert {v["content"] for v in cfg["added_tokens_decoder"].values()} == set(SPECIALS)
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


def test_add_bos_and_digit_pre_tokenizer(tmp_path: Path, bpe: Tokenizer) -> None:
    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", Q.F32, tokenizer=bpe, pre="smollm", add_bos=True)
    out = convert_gguf(path, tmp_path / "hf", progress=False)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    # smollm splits every digit off before the GPT-2 split, so the trained "Ġ2024"-style merges never apply.
    split_digits = bpe.encode("Hello").ids + [bpe.token_to_id("Ġ")] + [bpe.token_to_id(c) for c in "2024"]
    assert split_digits != bpe.encode("Hello 2024").ids
    assert tok.encode("Hello 2024").ids == [1] + split_digits
    assert tok.encode("Hello", add_special_tokens=False).ids == bpe.encode("Hello").ids
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True


def _random_kquant_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (uint8 `[rows, cols / 256 * bytes]`) with sane float16 scales."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        blocks[:, -2:] = scales[:, :2]  # d is the last field
    else:
        blocks[:, 0:4] = scales  # d, dmin lead
    return blocks.reshape(rows, -1)


def test_k_quants_dequantised_and_unpermuted(tmp_path: Path, bpe: Tokenizer) -> None:
    rng = np.random.default_rng(0)
    cfg = dict(
        max_position_embeddings=64,
        hidden_size=256,
        num_hidden_layers=1,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    )
    raw = {
        "token_embd.weight": (_random_kquant_blocks(bpe.get_vocab_size(), 256, Q.Q4_K, rng), Q.Q4_K),
        "blk.0.attn_q.weight": (_random_kquant_blocks(256, 256, Q.Q5_K, rng), Q.Q5_K),
        "blk.0.attn_k.weight": (_random_kquant_blocks(128, 256, Q.Q6_K, rng), Q.Q6_K),
        "blk.0.ffn_down.weight": (_random_kquant_blocks(256, 256, Q.Q4_K, rng), Q.Q4_K),
    }
    norm = {"model.norm.weight": rng.standard_normal(256).astype(np.float32)}
    path = write_gguf(tmp_path / "k.gguf", "llama", cfg, norm, tokenizer=bpe, raw=raw)
    got = load_file(str(convert_gguf(path, tmp_path / "hf", progress=False) / "model.safetensors"))
    for gname, hname, heads in [
        ("token_embd.weight", "model.embed_tokens.weight", None),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 4),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", 2),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None),
    ]:
        blocks, kind = raw[gname]
        want = gguf.quants.dequantize(blocks, kind)
        mine = got[hname].numpy()
        assert np.isfinite(mine).all() and np.abs(mine).max() > 0
        back = llama_cpp_permute(mine, heads) if heads else mine  # re-permuting gives the file's rows
        np.testing.assert_array_equal(back, want, err_msg=hname)
    np.testing.assert_array_equal(got["model.norm.weight"].numpy(), norm["model.norm.weight"])


def test_bfloat16_output(tmp_path: Path, bpe: Tokenizer) -> None:
    path, model = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", Q.F32, tokenizer=bpe)
    out = convert_gguf(path, tmp_path / "hf", progress=False, dtype="bfloat16")
    got = load_file(str(out / "model.safetensors"))
    for name, ref in model.state_dict().items():
        assert got[name].dtype == torch.bfloat16
        torch.testing.assert_close(got[name], ref.bfloat16(), rtol=0, atol=0, msg=name)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_unsupported_inputs_are_clear_errors(tmp_path: Path, bpe: Tokenizer) -> None:
    path, model = write_tiny_gguf(tmp_path / "ok.gguf", "llama", Q.F32, tokenizer=bpe)
    cfg = hf_config_dict(model)
    tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}

    with pytest.raises(ValueError, match=r"architecture 'falcon'.*llama.*qwen2.*qwen3"):
        convert_gguf(write_gguf(tmp_path / "a.gguf", "falcon", cfg, tensors, tokenizer=bpe), tmp_path / "a")
    int8 = {"blk.0.attn_q.weight": (np.ones((64, 64), dtype=np.int8).view(np.uint8), Q.I8)}
    with pytest.raises(ValueError, match=r"tensor type I8.*Q4_1.*Q4_K.*Q8_0"):
        convert_gguf(write_gguf(tmp_path / "b.gguf", "llama", cfg, {}, tokenizer=bpe, raw=int8), tmp_path / "b")
    with pytest.raises(ValueError, match=r"tokenizer model 'llama'.*gpt2"):
        convert_gguf(
            write_gguf(tmp_path / "c.gguf", "llama", cfg, tensors, tokenizer=bpe, tokenizer_model="llama"),
            tmp_path / "c",
        )
    with pytest.raises(ValueError, match=r"pre-tokenizer.*'no-such-pre'.*smollm"):
        convert_gguf(
            write_gguf(tmp_path / "d.gguf", "llama", cfg, tensors, tokenizer=bpe, pre="no-such-pre"), tmp_path / "d"
        )
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf(path, tmp_path / "e", dtype="float16")
    with pytest.raises(ValueError, match="not found"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "f")
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"} <= SUPPORTED_TENSOR_TYPES
