"""load_model: safetensors only, sharded checkpoints, name/shape checks, dtype policy, tying."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helexa.model.loader import load_model, resolve_dtype, safetensors_files
from tests.support.models import PagedCache, make_tiny_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("loader"), "llama")


def _copy_with(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file model directory, passing its tensors through `edit(dict) -> dict`."""
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors")
    return dst


def _run_prefill(model, tokens: list[int]) -> torch.Tensor:
    cache = PagedCache(model.config, num_blocks=16, block_size=4, dtype=model.dtype)
    step = cache.step({0: tokens}, all_logits=True)
    return model(step.input_ids, step.positions, step.attn, cache.kv_caches, step.logits_indices)


def test_fused_parameters_hold_the_checkpoint_tensors(llama_dir: Path) -> None:
    model = load_model(llama_dir, dtype="float32", attention_backend="torch")
    ckpt = load_file(llama_dir / "model.safetensors")
    attn = model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split((attn.q_size, attn.kv_size, attn.kv_size))
    assert torch.equal(q, ckpt["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(k, ckpt["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(v, ckpt["model.layers.1.self_attn.v_proj.weight"])
    gate, up = model.model.layers[0].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(gate, ckpt["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(up, ckpt["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(model.lm_head.weight, ckpt["lm_head.weight"])
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert tensor.device.type == "cpu", name
        assert not tensor.requires_grad, name
    assert not model.training


def test_sharded_checkpoint_loads_the_same_model(tmp_path: Path, llama_dir: Path) -> None:
    sharded = make_tiny_model(tmp_path, "llama", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert len(safetensors_files(sharded)) > 1
    a = load_model(sharded, dtype="float32", attention_backend="torch")
    b = load_model(llama_dir, dtype="float32", attention_backend="torch")
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name


def test_bfloat16_load_casts_every_parameter(llama_dir: Path) -> None:
    model = load_model(llama_dir, dtype="bfloat16", attention_backend="torch")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.dtype == torch.bfloat16 and model.device == torch.device("cpu")
    ckpt = load_file(llama_dir / "model.safetensors")
    assert torch.equal(model.model.norm.weight, ckpt["model.norm.weight"].to(torch.bfloat16))
    reference = _run_prefill(load_model(llama_dir, dtype="float32", attention_backend="torch"), [5, 9, 17, 3, 44])
    logits = _run_prefill(model, [5, 9, 17, 3, 44])
    assert logits.dtype == torch.float32
    assert (logits - reference).abs().max() < 0.25  # bf16 rounding, not a different model


def test_tied_embeddings_need_no_lm_head(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "qwen2", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = load_model(path, dtype="float32", attention_backend="torch")
    assert model.lm_head is None
    assert model.output_weight is model.model.embed_tokens.weight


def test_missing_tensor_is_named(tmp_path: Path, llama_dir: Path) -> None:
    def drop(t: dict) -> dict:
        del t["model.layers.1.self_attn.k_proj.weight"]
        return t

    path = _copy_with(llama_dir, tmp_path / "m", drop)
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path, attention_backend="torch")


def test_untied_model_without_lm_head_is_refused(tmp_path: Path, llama_dir: Path) -> None:
    def drop(t: dict) -> dict:
        del t["lm_head.weight"]
        return t

    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(_copy_with(llama_dir, tmp_path / "m", drop), attention_backend="torch")


def test_misshaped_tensor_names_tensor_and_shapes(tmp_path: Path, llama_dir: Path) -> None:
    def shrink(t: dict) -> dict:
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:100].contiguous()
        return t

    path = _copy_with(llama_dir, tmp_path / "m", shrink)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(128, 64\).*\(100, 64\)"):
        load_model(path, attention_backend="torch")


def test_unexpected_tensor_is_named(tmp_path: Path, llama_dir: Path) -> None:
    def add(t: dict) -> dict:
        t["model.layers.0.self_attn.extra.weight"] = torch.randn(4)
        return t

    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.extra\.weight'"):
        load_model(_copy_with(llama_dir, tmp_path / "m", add), attention_backend="torch")


def test_pickle_only_directory_is_refused(tmp_path: Path, llama_dir: Path) -> None:
    (tmp_path / "config.json").write_bytes((llama_dir / "config.json").read_bytes())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match=r"pickle-format weights \(pytorch_model\.bin\).*safetensors only"):
        load_model(tmp_path, attention_backend="torch")


def test_index_naming_absent_shard_is_refused(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "qwen3", max_shard_size="100KB")
    shards = sorted(path.glob("*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(ValueError, match=shards[-1].name):
        load_model(path, attention_backend="torch")


def test_unknown_attention_backend_is_refused(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="attention backend"):
        load_model(llama_dir, attention_backend="flash")


@pytest.mark.parametrize(
    "name, device, config_dtype, expected",
    [
        ("auto", "cpu", None, torch.float32),
        ("auto", "cpu", torch.bfloat16, torch.float32),
        ("float16", "cpu", None, torch.float16),
        ("bfloat16", "cuda", None, torch.bfloat16),
        (torch.float32, "cuda", None, torch.float32),
    ],
)
def test_resolve_dtype(name, device, config_dtype, expected) -> None:
    assert resolve_dtype(name, device, config_dtype) == expected


def test_resolve_dtype_auto_on_cuda_prefers_half_precision() -> None:
    assert resolve_dtype("auto", "cuda", torch.float16) == torch.float16
    assert resolve_dtype("auto", "cuda", torch.float32) in (torch.bfloat16, torch.float16)


def test_resolve_dtype_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8", "cpu")
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype(torch.int8, "cpu")
