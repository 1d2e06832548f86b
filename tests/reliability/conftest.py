"""Reliability test fixtures: the tiny chat model directory, once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.servers import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server tests' tiny chat model (random Llama, byte-level BPE, Llama-3 chat template)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("reliability_model"))
