"""Server test fixtures: one tiny model directory per session, and the main server over it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.servers import RunningServer, make_tiny_model_dir, tiny_engine_config


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("server_model"))


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """The main server: 256 blocks of 16 tokens, max_model_len 2048, 4 sequences, no API key."""
    running = RunningServer(tiny_engine_config(tiny_model_dir, num_blocks=256, max_num_seqs=4))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
