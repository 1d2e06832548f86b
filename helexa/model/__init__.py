"""helexa.model: the network (`ModelConfig`, `CausalLM` over the paged KV cache, `load_model`), and
`text/` (tokenizer, chat templates, detokenizer, stop strings), `sampling/`, `weights/` (GGUF, pull)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from helexa.lazy import lazy_attributes

# Each name is imported from its module when first read: `ModelConfig` (a config.json's facts) needs no torch,
# the network and its loader do.
_HOME = {
    "ModelConfig": "helexa.model.config",
    "load_model": "helexa.model.loader",
    "resolve_dtype": "helexa.model.loader",
    "CausalLM": "helexa.model.transformer",
}

if TYPE_CHECKING:
    from helexa.model.config import ModelConfig
    from helexa.model.loader import load_model, resolve_dtype
    from helexa.model.transformer import CausalLM


__getattr__ = lazy_attributes(__name__, _HOME)


__all__ = ["CausalLM", "ModelConfig", "load_model", "resolve_dtype"]
