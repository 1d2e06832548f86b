"""GGUF import: synthetic GGUF files written from tiny random Hugging Face models, converted back.

The oracle is the model the GGUF was written from: tensors must come back exactly (F32) or
within the quantisation error of their type, with llama's q/k permutation undone, and
transformers running the converted directory must give the original model's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from helexa.model.weights.gguf import SUPPORTED_TENSOR_TYPES, convert_gguf
from tests.support.gguf import (
    CHAT_TEMPLATE,
    SAMPLES,
    SPECIALS,
    Q,
    hf_config_dict,
    llama_cpp_permute,
    train_tiny_bpe,
    write_gguf,
    write_tiny_gguf,
)


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
    out = convert_gguf(path, tmp_path / "hf", progress=False, keep_quantized=False)  # kept: tests/model/test_quant.py
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
