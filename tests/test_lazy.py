"""Packages that export names lazily (`helexa.lazy.lazy_attributes`): every exported name resolves, to the object
its module defines, and anything else is an AttributeError; the light names import no torch."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest

from helexa.lazy import lazy_attributes

LAZY_PACKAGES = ["helexa.engine", "helexa.kvcache", "helexa.model", "helexa.model.sampling", "helexa.model.weights"]


@pytest.mark.parametrize("name", LAZY_PACKAGES)
def test_every_exported_name_resolves_to_its_module_s_object(name: str) -> None:
    package = importlib.import_module(name)
    assert package.__all__, name
    for export in package.__all__:
        value = getattr(package, export)
        home = getattr(value, "__module__", None)
        if isinstance(value, (type, types.FunctionType)) and home is not None:
            assert getattr(importlib.import_module(home), export) is value, (name, export, home)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        package.not_a_name  # noqa: B018


def test_lazy_attributes_imports_on_first_read_and_caches() -> None:
    namespace = types.ModuleType("helexa_lazy_probe")
    sys.modules["helexa_lazy_probe"] = namespace
    try:
        getter = lazy_attributes("helexa_lazy_probe", {"dumps": "json"})
        assert getter("dumps") is importlib.import_module("json").dumps
        assert namespace.__dict__["dumps"] is importlib.import_module("json").dumps  # later reads skip the getter
        with pytest.raises(AttributeError, match="'helexa_lazy_probe' has no attribute 'loads'"):
            getter("loads")
    finally:
        del sys.modules["helexa_lazy_probe"]


def test_the_light_names_import_no_torch() -> None:
    """What the server's side of an engine core reads: none of it loads torch (a fresh interpreter)."""
    code = (
        "import sys\n"
        "from helexa.engine import EngineClient, TokenEvent, RequestHandle, EngineCounters, DeviceFault\n"
        "from helexa.kvcache import KVBudget, KVSurvey, HoldingView, CacheSurvey, BlockStates, parse_size\n"
        "from helexa.model import ModelConfig\n"
        "from helexa.model.sampling import SamplingParams\n"
        "from helexa.model.weights import resolve_model, DEFAULT_MODEL\n"
        "import helexa.server.__main__, helexa.server.app\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
        "assert not loaded, loaded[:10]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def _type_checking_homes(init: Path) -> dict[str, str]:
    """Name -> module of the `from M import name` lines under the package's `if TYPE_CHECKING:`."""
    homes: dict[str, str] = {}
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.module:
                    homes.update({alias.asname or alias.name: stmt.module for alias in stmt.names})
    return homes


@pytest.mark.parametrize("name", LAZY_PACKAGES)
def test_the_checker_s_imports_and_the_runtime_map_name_the_same_homes(name: str) -> None:
    """A lazy package states each lazy name's module twice: in its `_HOME` map (what runs) and under
    `TYPE_CHECKING` (what mypy reads). Both must say the same; every other exported name is imported eagerly."""
    package = importlib.import_module(name)
    assert _type_checking_homes(Path(package.__file__)) == package._HOME, name
    eager = set(package.__all__) - set(package._HOME)
    assert all(export in vars(package) for export in eager), (name, sorted(eager))
