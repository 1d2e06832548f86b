"""helexa.model.weights: model files — GGUF import and the pull of known models into `$HELEXA_HOME`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from helexa.lazy import lazy_attributes
from helexa.model.weights.pull import DEFAULT_MODEL, KNOWN_MODELS, DownloadError, resolve_model

if TYPE_CHECKING:
    from helexa.model.weights.gguf import convert_gguf

_HOME = {"convert_gguf": "helexa.model.weights.gguf"}  # numpy, torch: imported on first use
__getattr__ = lazy_attributes(__name__, _HOME)

__all__ = ["DEFAULT_MODEL", "KNOWN_MODELS", "DownloadError", "convert_gguf", "resolve_model"]
