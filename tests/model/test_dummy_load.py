"""`load_format="dummy"` (`--load-format dummy`): a model of the shapes config.json gives, with seeded random
weights made on the device, no weight file read; what the GPU benchmarks build an 8B shape with."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from helexa.config import EngineConfig
from helexa.engine.engine import Engine
from helexa.model.loader import load_model
from helexa.model.quant.linear import QuantLinear
from helexa.model.sampling import SamplingParams
from tests.support.engines import assert_released, drive, tokens
from tests.support.models import tiny_llama_chat_model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_chat_model(tmp_path_factory.mktemp("tiny_dummy"))


@pytest.fixture(scope="module")
def config_only(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model's directory without its weights: config.json, tokenizer, template."""
    path = tmp_path_factory.mktemp("dummy") / "model"
    shutil.copytree(tiny_model_dir, path, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    assert not list(path.glob("*.safetensors"))
    return path


def test_the_weights_are_seeded_random_values_of_the_checkpoint_s_shapes(config_only, tiny_model_dir):
    real = load_model(tiny_model_dir, dtype="float32")
    dummy = load_model(config_only, dtype="float32", load_format="dummy")
    again = load_model(config_only, dtype="float32", load_format="dummy")
    shapes = {n: t.shape for n, t in real.state_dict().items()}
    assert {n: t.shape for n, t in dummy.state_dict().items()} == shapes
    for name, t in dummy.state_dict().items():
        assert torch.equal(t, again.state_dict()[name]), name  # the same values on every load
        assert torch.isfinite(t).all() and t.std() > 0, name  # random, never zeros
        if name.endswith("norm.weight"):
            assert (t - 1).abs().max() < 0.6, name
        elif t.dim() == 2 and "embed_tokens" not in name:
            assert 0.5 < t.std() * t.shape[-1] ** 0.5 < 1.5, name  # unit-variance outputs
    names = list(shapes)
    assert not torch.equal(dummy.state_dict()[names[1]].flatten()[:8], dummy.state_dict()[names[2]].flatten()[:8])


def test_dummy_weights_quantize_at_load_like_a_checkpoint_s(config_only):
    model = load_model(config_only, dtype="float32", quantization="int4", load_format="dummy")
    assert any(isinstance(m, QuantLinear) for m in model.modules())


def test_an_engine_serves_a_dummy_model_deterministically(config_only):
    config = dict(model=str(config_only), device="cpu", dtype="float32", attention_backend="torch", num_blocks=64,
                  block_size=8, max_num_batched_tokens=64, load_format="dummy")  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = []
    for _ in range(2):
        engine = Engine(EngineConfig.of(**config))
        handle = engine.submit([5, 9, 40, 7], params)
        outputs.append(tokens(drive(engine, [handle])[handle.request_id]))
        assert_released(engine)
    assert len(outputs[0]) == 6 and outputs[0] == outputs[1]


def test_an_unknown_load_format_is_refused(config_only):
    with pytest.raises(ValueError, match="load_format"):
        load_model(config_only, load_format="npz")
    with pytest.raises(ValueError, match="load.format"):
        EngineConfig.of(model=str(config_only), load_format="npz")
