"""helexa.model: the network (`ModelConfig`, `CausalLM` over the paged KV cache, `load_model`), and
`text/` (tokenizer, chat templates, detokenizer, stop strings), `sampling/`, `weights/` (GGUF, pull)."""

from helexa.model.config import ModelConfig
from helexa.model.loader import load_model, resolve_dtype
from helexa.model.transformer import CausalLM

__all__ = ["CausalLM", "ModelConfig", "load_model", "resolve_dtype"]
