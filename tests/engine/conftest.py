"""A tiny random Llama with a real byte-level BPE tokenizer and chat template, for engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import tiny_llama_chat_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory: tiny random Llama weights (vocab 512) + a trained ~400-token tokenizer."""
    return tiny_llama_chat_model(tmp_path_factory.mktemp("tiny_engine"))
