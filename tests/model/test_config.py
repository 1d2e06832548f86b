"""ModelConfig: parsing of transformers 4.x and 5.x config.json layouts, derived values, errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from helexa.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from tests.support.models import tiny_hf_config


def _saved_config(tmp_path: Path, arch: str, **overrides) -> dict:
    """config.json as this transformers version's save_pretrained writes it."""
    tiny_hf_config(arch, **overrides).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


LLAMA_4X = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def test_llama_4x_layout_with_llama3_scaling() -> None:
    config = ModelConfig.from_dict(LLAMA_4X)
    assert config.architecture == "LlamaForCausalLM"
    assert config.head_dim == 128  # hidden / heads
    assert config.num_queries_per_kv == 4
    assert (config.q_size, config.kv_size, config.qkv_size) == (4096, 1024, 6144)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert config.dtype == "bfloat16"
    assert config.bos_token_id == 128000
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert config.max_model_len == 131072
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 32 * 1024 * 2
    assert not (config.qkv_bias or config.o_bias or config.qk_norm or config.mlp_bias)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 1  # type: ignore[misc]


def test_legacy_linear_scaling_with_type_key() -> None:
    d = {**LLAMA_4X, "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    config = ModelConfig.from_dict(d)
    assert config.rope_scaling == RopeScaling("linear", 2.0)
    assert config.rope_theta == 10000.0


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_saved_config_matches_transformers_parameter_count(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    overrides = {"tie_word_embeddings": arch == "qwen2", "attention_bias": arch == "qwen3"}
    d = _saved_config(tmp_path, arch, **overrides)
    assert "rope_parameters" in d  # the 5.x layout is what is being parsed here
    config = ModelConfig.from_dict(d)
    hf_model = AutoModelForCausalLM.from_config(tiny_hf_config(arch, **overrides))
    assert config.num_parameters == sum(p.numel() for p in hf_model.parameters())
    assert config.head_dim == 16 and config.num_key_value_heads == 2
    assert config.rope_scaling is None and config.rope_theta == 10000.0
    assert config.tie_word_embeddings == (arch == "qwen2")
    assert config.qkv_bias == (arch in ("qwen2", "qwen3"))
    assert config.o_bias == (arch == "qwen3")
    assert config.qk_norm == (arch == "qwen3")
    assert config.eos_token_ids == (2,)


def test_mistral_sliding_window_caps_max_model_len(tmp_path: Path) -> None:
    d = _saved_config(tmp_path, "mistral", sliding_window=64, max_position_embeddings=256)
    config = ModelConfig.from_dict(d)
    assert config.architecture == "MistralForCausalLM"
    assert config.sliding_window == 64
    assert config.max_model_len == 64
    d["sliding_window"] = None
    assert ModelConfig.from_dict(d).max_model_len == 256


def test_qwen2_sliding_window_only_when_enabled(tmp_path: Path) -> None:
    d = _saved_config(tmp_path, "qwen2", sliding_window=32, use_sliding_window=True)
    assert ModelConfig.from_dict(d).max_model_len == 32
    d["use_sliding_window"] = False  # Qwen2 checkpoints often keep a window value they do not use
    assert ModelConfig.from_dict(d).sliding_window is None


def test_saved_llama3_rope_parameters(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 1000.0,
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 2.0,
        "original_max_position_embeddings": 64,
    }
    config = ModelConfig.from_dict(_saved_config(tmp_path, "llama", rope_parameters=rope))
    assert config.rope_theta == 1000.0
    assert config.rope_scaling == RopeScaling("llama3", 4.0, 1.0, 2.0, 64)


def test_from_pretrained_reads_directory(tmp_path: Path) -> None:
    _saved_config(tmp_path, "qwen3")
    assert ModelConfig.from_pretrained(tmp_path).architecture == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path / "absent")


def test_unknown_architecture_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        ModelConfig.from_dict({**LLAMA_4X, "architectures": ["GPT2LMHeadModel"]})
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_key_value_heads": 5}, "multiple of num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type 'yarn'"),
        ({"rope_scaling": {"rope_type": "linear"}}, "needs a 'factor'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"torch_dtype": "int8"}, "dtype"),
        ({"num_attention_heads": 7, "hidden_size": 4096}, "not divisible"),
    ],
)
def test_invalid_configs_raise_clear_errors(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**LLAMA_4X, **change})


def test_model_type_stands_in_for_missing_architectures() -> None:
    d = {k: v for k, v in LLAMA_4X.items() if k != "architectures"}
    assert ModelConfig.from_dict({**d, "model_type": "qwen2"}).architecture == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        ModelConfig.from_dict({**d, "model_type": "gpt2"})


def test_explicit_head_dim_wins() -> None:
    config = ModelConfig.from_dict({**LLAMA_4X, "head_dim": 64})
    assert config.head_dim == 64 and config.q_size == 32 * 64
