"""Compile the Triton kernels for an H200 (sm_90) on this CPU-only machine.

The interpreter tests check what the kernels compute; they cannot catch code only the compiler
rejects (loop-carried type changes, unsupported ops) or tiles that overflow shared memory.
`triton.compile` runs the whole CUDA pipeline down to a cubin (Triton ships ptxas) with no GPU.
It runs in a subprocess without TRITON_INTERPRET (see `_compile_sm90.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SHARED_MEMORY_LIMIT = 232_448  # bytes of dynamic shared memory per block on sm_90
HERE = Path(__file__).parent
REPO = HERE.parent.parent


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton's CUDA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(HERE / "_compile_sm90.py")], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        pytest.fail(f"compiling for sm_90 failed:\n{proc.stderr[-4000:]}")
    return {r["name"]: r for r in map(json.loads, proc.stdout.splitlines())}


@pytest.mark.parametrize("name", ["bf16-decode-split", "bf16-prefill", "fp32-prefill", "fp16-d256-gqa8-prefill"])
def test_attention_kernel_compiles_for_h200(compiled, name):
    result = compiled[name]
    assert result["shared"] <= SHARED_MEMORY_LIMIT
    assert result["async_copy"], "K/V loads should be software-pipelined (cp.async)"
    if "prefill" in name and not name.startswith("fp32"):
        assert result["wgmma"], "prefill tiles should use Hopper wgmma"


def test_reduce_and_write_kv_compile_for_h200(compiled):
    assert compiled["reduce"]["shared"] <= SHARED_MEMORY_LIMIT
    assert compiled["write_kv"]["global_store"]


@pytest.mark.parametrize("name", ["dense-bf16", "dense-bf16-split"])
def test_the_dense_matmul_compiles_for_h200_on_wgmma(compiled, name):
    """The batch-invariant matmul of the linear layers (one tiling for every M) at its default config."""
    result = compiled[name]
    assert result["shared"] <= SHARED_MEMORY_LIMIT
    assert result["wgmma"], "64-row tiles should use Hopper wgmma"
    assert result["async_copy"], "x and weight loads should be software-pipelined (cp.async)"
