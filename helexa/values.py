"""Generic value checks and parsing, shared by every package: ints that are not bools, finite numbers,
sizes such as "512MiB", and the one reader of `HELEXA_DEBUG`. Imports nothing of helexa's (and no torch)."""

from __future__ import annotations

import math
import os
import re
from typing import Any

__all__ = ["check_int", "debug_enabled", "is_int", "is_number", "parse_size"]

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_UNITS = {"": 1, "b": 1, **{u: 1024**i for i, u in enumerate(("k", "m", "g", "t"), 1)}}
_UNITS.update({f"{u}ib": 1024**i for i, u in enumerate(("k", "m", "g", "t"), 1)})
_UNITS.update({f"{u}b": 1000**i for i, u in enumerate(("k", "m", "g", "t"), 1)})


def debug_enabled() -> bool:
    """True when `HELEXA_DEBUG` is set to anything but `0`: invariant checks that cost a sync run after every change."""
    return os.environ.get("HELEXA_DEBUG", "0") not in ("", "0")


def parse_size(text: str | int) -> int:
    """Bytes in a size such as "512MiB", "2GiB", "1.5G", "4096" (an int is returned as is).

    KiB/MiB/GiB/TiB and bare K/M/G/T are powers of 1024; KB/MB/GB/TB powers of 1000; case is
    ignored. Raises `ValueError` for anything else or a size below one byte.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"not a size: {text!r} (expected e.g. 512MiB, 2GiB, 1.5G, 4096)")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"size must be at least 1 byte, got {text!r}")
    return value


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def check_int(value: Any, name: str, minimum: int = 1) -> int:
    """`value` if it is an int (not a bool) >= `minimum`, else a ValueError naming `name`."""
    if not is_int(value) or value < minimum:
        kind = "non-negative" if minimum == 0 else "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be a {kind} int (>= {minimum}), got {value!r}")
    return value


def is_number(v: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
