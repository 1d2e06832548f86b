"""helexa.model: the transformer over the paged cache and everything around it.

Module map:
- `config`         `ModelConfig` from a Hugging Face config.json (Llama, Mistral, Qwen2, Qwen3).
- `rope`, `layers` RoPE, RMSNorm, attention (write_kv + paged_attention), SwiGLU MLP.
- `transformer`    `CausalLM`: a forward over a flattened varlen batch, logits only where sampled.
- `loader`         `load_model`, `resolve_dtype`: safetensors only, mmap, meta-device build.
- `tokenizer`      `Tokenizer`: tokenizer.json + tokenizer_config/generation_config special tokens.
- `chat_template`  `ChatTemplate`: HF chat templates in a sandboxed Jinja2 environment.
- `detokenizer`    `IncrementalDetokenizer`: streaming text that never splits a UTF-8 character.
- `sampling`       `SamplingParams`, `Sampler`: one vectorised sampling call per step.
- `stopping`       `StopChecker`, `finish_reason`: stop strings across token boundaries.
- `gguf`           `convert_gguf`: a GGUF file to a Hugging Face style directory.
- `pull`           `pull`, `resolve_model`: known models fetched and converted into `$HELEXA_HOME`.
"""

from helexa.model.chat_template import ChatTemplate, ChatTemplateError, validate_messages
from helexa.model.config import ModelConfig
from helexa.model.detokenizer import IncrementalDetokenizer
from helexa.model.gguf import convert_gguf
from helexa.model.loader import load_model, resolve_dtype
from helexa.model.pull import DEFAULT_MODEL, KNOWN_MODELS, DownloadError, resolve_model
from helexa.model.sampling import MAX_LOGPROBS, SampleResult, Sampler, SamplingParams, make_generator
from helexa.model.stopping import StopChecker, StopResult, finish_reason
from helexa.model.tokenizer import Tokenizer
from helexa.model.transformer import CausalLM

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "MAX_LOGPROBS",
    "CausalLM",
    "ChatTemplate",
    "ChatTemplateError",
    "DownloadError",
    "IncrementalDetokenizer",
    "ModelConfig",
    "SampleResult",
    "Sampler",
    "SamplingParams",
    "StopChecker",
    "StopResult",
    "Tokenizer",
    "convert_gguf",
    "finish_reason",
    "load_model",
    "make_generator",
    "resolve_dtype",
    "resolve_model",
    "validate_messages",
]
