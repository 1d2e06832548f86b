"""Model configuration: a frozen view of a Hugging Face `config.json` for the supported decoders, in
the transformers 4.x layout (top-level `rope_theta`, `rope_scaling`, `torch_dtype`) or the 5.x one
(`rope_parameters` holding `rope_theta` and `rope_type`, `dtype`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from helexa.values import check_int, is_int

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_NAMES", "SUPPORTED_ARCHITECTURES", "ModelConfig", "RopeScaling"]


class _Arch(NamedTuple):
    """What distinguishes one supported architecture from another (all share the Llama block)."""

    qkv_bias: bool | None  # None: follow the config's `attention_bias` (so does o_bias)
    o_bias: bool | None
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window_flag: str | None  # config key that switches `sliding_window` on; None: always on


_ARCHITECTURES = {
    "LlamaForCausalLM": _Arch(None, None, False, None),
    "MistralForCausalLM": _Arch(False, False, False, None),
    "Qwen2ForCausalLM": _Arch(True, False, False, "use_sliding_window"),
    "Qwen3ForCausalLM": _Arch(None, None, True, "use_sliding_window"),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHITECTURES)
# `model_type` -> architecture, for configs without an `architectures` list ("qwen2" -> Qwen2ForCausalLM).
_MODEL_TYPES = {arch.removesuffix("ForCausalLM").lower(): arch for arch in _ARCHITECTURES}
_POSITIVE_INTS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
    "max_position_embeddings"
).split()
DTYPE_NAMES = ("float32", "float16", "bfloat16")  # the dtypes a checkpoint may name (`torch_dtype`) and helexa runs


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency rescaling: `rope_type` "linear" (every frequency divided by `factor`) or "llama3"
    (the fields below are set; see `helexa.model.transformer.rope_inv_freq`)."""

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    """The architecture hyper-parameters helexa needs to build and load a decoder-only model.

    Guarantees (checked at construction): positive sizes, `num_attention_heads` a multiple of
    `num_key_value_heads`, an even `head_dim`, a SiLU-gated MLP, and a supported architecture.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str = "silu"
    dtype: str | None = None  # the checkpoint's dtype, one of `DTYPE_NAMES`, when config.json names one
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in _ARCHITECTURES:
            raise _unsupported_architecture(self.architecture)
        for name in _POSITIVE_INTS:
            check_int(getattr(self, name), f"config {name}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; only 'silu' (SwiGLU) is supported")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")

    @property
    def q_size(self) -> int:  # width of the query projection
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:  # width of the key (and of the value) projection
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_size(self) -> int:  # width of the fused q/k/v projection
        return self.q_size + 2 * self.kv_size

    @property
    def num_queries_per_kv(self) -> int:  # GQA group size: query heads sharing one KV head
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def max_model_len(self) -> int:
        """Longest sequence this model computes exactly: the position limit, capped by a sliding window
        (helexa attends over the full context, which equals windowed attention only up to the window)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers when the cache holds `dtype`."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype.itemsize

    @property
    def num_parameters(self) -> int:
        """Parameter count of the model helexa builds (a tied lm_head counted once)."""
        attn = self.hidden_size * self.qkv_size + self.q_size * self.hidden_size
        attn += self.qkv_size * self.qkv_bias + self.hidden_size * self.o_bias + 2 * self.head_dim * self.qk_norm
        mlp = 3 * self.hidden_size * self.intermediate_size
        mlp += (2 * self.intermediate_size + self.hidden_size) * self.mlp_bias
        embed = self.vocab_size * self.hidden_size
        layer = attn + mlp + 2 * self.hidden_size
        return embed * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * layer + self.hidden_size

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `path/config.json` (or `path` itself when it is a file). Raises `ValueError` for a
        missing file, invalid JSON, or an unsupported model."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"no config.json at {path}")
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file} is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a parsed Hugging Face config dict. Raises `ValueError` naming the supported
        architectures for an unknown one, and naming the key for a missing or invalid field."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        archs = d.get("architectures") or []
        if not archs and d.get("model_type") in _MODEL_TYPES:
            archs = [_MODEL_TYPES[d["model_type"]]]
        known = [a for a in archs if a in _ARCHITECTURES]
        if not known:
            raise _unsupported_architecture(archs or d.get("model_type"))
        traits = _ARCHITECTURES[known[0]]
        hidden_size = _require_int(d, "hidden_size")
        num_heads = _require_int(d, "num_attention_heads")
        head_dim = d.get("head_dim")
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ValueError(
                    f"config has no head_dim and hidden_size {hidden_size} is not divisible by "
                    f"num_attention_heads {num_heads}"
                )
            head_dim = hidden_size // num_heads
        attention_bias = bool(d.get("attention_bias", False))
        rope_theta, rope_scaling = _parse_rope(d)
        sliding_window = d.get("sliding_window")
        if traits.sliding_window_flag is not None and not d.get(traits.sliding_window_flag, False):
            sliding_window = None
        bos, eos = d.get("bos_token_id"), d.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else [eos]
        eos_ids = tuple(_token_id(v, "eos_token_id") for v in eos_list if v is not None)
        dtype = str(d.get("dtype") or d.get("torch_dtype") or "").removeprefix("torch.")
        if dtype and dtype not in DTYPE_NAMES:
            raise ValueError(f"unsupported checkpoint dtype {dtype!r}; expected one of {sorted(DTYPE_NAMES)}")
        return cls(
            architecture=known[0],
            vocab_size=_require_int(d, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_require_int(d, "intermediate_size"),
            num_hidden_layers=_require_int(d, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if traits.qkv_bias is None else traits.qkv_bias,
            o_bias=attention_bias if traits.o_bias is None else traits.o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=traits.qk_norm,
            hidden_act=str(d.get("hidden_act", "silu")),
            dtype=dtype or None,
            bos_token_id=None if bos is None else _token_id(bos, "bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=None if sliding_window is None else int(sliding_window),
        )


def _unsupported_architecture(name: object) -> ValueError:
    return ValueError(f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _require_int(d: dict[str, Any], key: str) -> int:
    if d.get(key) is None:
        raise ValueError(f"config.json is missing {key!r}")
    try:
        return int(d[key])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config {key!r} must be an integer, got {d[key]!r}") from exc


def _token_id(value: Any, key: str) -> int:
    if not is_int(value):
        raise ValueError(f"config {key!r} must be an integer or null, got {value!r}")
    return value


def _parse_rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either `rope_parameters` (transformers 5) or `rope_scaling` (4.x)."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope parameters must be an object, got {params!r}")
    theta = params.get("rope_theta", d.get("rope_theta"))
    theta = 10000.0 if theta is None else float(theta)
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor {partial} is not supported (only full rotary embeddings)")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, linear, llama3")
    if "factor" not in params:
        raise ValueError(f"rope type {rope_type!r} needs a 'factor'")
    factor = float(params["factor"])
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"rope factor must be positive, got {factor}")
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor)
    missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise ValueError(f"llama3 rope scaling is missing {missing}")
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    if not high > low:
        raise ValueError(f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got {high} <= {low}")
    original = params.get("original_max_position_embeddings") or d.get("max_position_embeddings")
    if original is None:
        raise ValueError("llama3 rope scaling needs original_max_position_embeddings")
    return theta, RopeScaling("llama3", factor, low, high, int(original))
