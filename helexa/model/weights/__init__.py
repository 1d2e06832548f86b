"""helexa.model.weights: model files — GGUF import and the pull of known models into `$HELEXA_HOME`."""

from helexa.model.weights.gguf import convert_gguf
from helexa.model.weights.pull import DEFAULT_MODEL, KNOWN_MODELS, DownloadError, resolve_model

__all__ = ["DEFAULT_MODEL", "KNOWN_MODELS", "DownloadError", "convert_gguf", "resolve_model"]
