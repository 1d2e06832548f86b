"""helexa's configuration tree: frozen dataclasses validated once, and the flags built from them."""

from __future__ import annotations

import os


def debug_enabled() -> bool:
    """True when `HELEXA_DEBUG` is set to anything but `0`: invariant checks that cost a sync run after every change."""
    return os.environ.get("HELEXA_DEBUG", "0") not in ("", "0")
