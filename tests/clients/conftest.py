"""The conformance suite: the real client libraries agent builders use, with their default settings,
against one real helexa server (uvicorn on 127.0.0.1) serving the default model (SmolLM2-135M-Instruct).

The versions tested are pinned in pyproject.toml's `test` extra; a test whose library cannot be
imported skips and says so. Where the 135M model's own choices could make a flow flaky, a test fixes
the seed, the temperature or the prompt, never what it asserts of the server.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.servers import RunningServer, tiny_engine_config, wait_for


def need(module: str, package: str) -> ModuleType:
    """`module` imported, or the test skipped naming the `package` (and extra) that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.skip(f"{package} is not importable ({exc}); install the test extra: pip install -e '.[test]'")


@pytest.fixture(scope="session")
def served(default_model_dir: Path) -> Iterator[RunningServer]:
    """One server for the whole suite: the default model, 512 blocks of 16 tokens, 4 sequences at once."""
    running = RunningServer(tiny_engine_config(default_model_dir, num_blocks=512, max_num_seqs=4))
    yield running
    running.stop()


@pytest.fixture
def base_url(served: RunningServer) -> Iterator[str]:
    """The OpenAI base URL of the suite's server; after each test, nothing is left in flight or reserved."""
    yield f"{served.url}/v1"

    def idle() -> bool:
        snapshot = served.engine.snapshot()
        return snapshot["in_flight"] == 0 and snapshot["blocks_reserved"] == 0

    assert wait_for(idle, 10), served.engine.snapshot()
