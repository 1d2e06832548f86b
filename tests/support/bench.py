"""Importing a benchmark script of `bench/` in a test, as the script itself runs: `bench/` first on the path and the
module loaded afresh (a test may patch what it imports)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """`bench/<name>.py` imported anew, with `bench/` on `sys.path` for this test only."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop(name, None)
    return importlib.import_module(name)
