"""A tiny random Llama with a real tokenizer, shared by the cluster tests (as in tests/engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import build_tiny_tokenizer_dir, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory: tiny random Llama weights (vocab 512) + a trained ~400-token tokenizer."""
    root = tmp_path_factory.mktemp("tiny_cluster")
    path = make_tiny_model(root, "llama", vocab_size=512, max_position_embeddings=512, name="model")
    build_tiny_tokenizer_dir(path)
    return path
