"""A tiny random Llama with a real byte-level BPE tokenizer and chat template, for engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from helexa.config import EngineConfig
from helexa.engine.engine import Engine
from tests.model.test_tokenizer import build_tiny_tokenizer_dir
from tests.model.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory: tiny random Llama weights (vocab 512) + a trained ~400-token tokenizer."""
    root = tmp_path_factory.mktemp("tiny_engine")
    path = make_tiny_model(root, "llama", vocab_size=512, max_position_embeddings=512, name="model")
    build_tiny_tokenizer_dir(path)
    return path


def make_engine(model_dir: Path, **overrides) -> Engine:
    """An engine on CPU with the torch attention backend and a small pool."""
    args = dict(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        num_blocks=64,
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_wait_secs=30.0,
    )
    args.update(overrides)
    return Engine(EngineConfig.of(**args))
