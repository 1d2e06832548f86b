"""helexa.model: the transformer over the paged KV cache, and the model's text, sampling and weights.

- `config`, `rope`, `layers`, `transformer`, `loader`: the network — `ModelConfig` from config.json
  (Llama, Mistral, Qwen2, Qwen3), `CausalLM` over a flattened varlen batch, `load_model` from safetensors.
- `text/`: tokenizer, chat templates, incremental detokenizer, stop strings.
- `sampling/`: `SamplingParams` and the vectorised `Sampler`.
- `weights/`: GGUF import and the default-model pull.
"""

from helexa.model.config import ModelConfig
from helexa.model.loader import load_model, resolve_dtype
from helexa.model.transformer import CausalLM

__all__ = ["CausalLM", "ModelConfig", "load_model", "resolve_dtype"]
