"""Package attributes imported from their modules when first read (PEP 562), so that importing a package for
one light name does not import torch with its heavy ones: `lazy_attributes`."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `homes` maps each exported name to the module defining it. The first
    read of a name imports its module and caches the value in the package; any other name is an AttributeError."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value
        return value

    return __getattr__
