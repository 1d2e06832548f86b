"""Tiny random Hugging Face models on disk, a tiny trained tokenizer, and a hand-built paged KV cache.

    path = make_tiny_model(tmp_path, arch="qwen3", tie_word_embeddings=True)
    hf = load_hf_model(path)                       # the transformers oracle (fp32, eager attention)
    cache = PagedCache(ModelConfig.from_pretrained(path), num_blocks=64, block_size=4)

Nothing is downloaded: the config is built in code, the model by `from_config` with a seeded
random init (wider than transformers' default so attention and norms are far from trivial), and
saved with `save_pretrained(safe_serialization=True)`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from helexa.kvcache.metadata import AttentionMetadata
from helexa.model.config import ModelConfig

__all__ = ["TINY_ARCHS", "PagedCache", "StepInputs", "load_hf_model", "make_tiny_model", "tiny_hf_config"]

# arch short name -> (transformers config class name, architectures entry)
TINY_ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

_TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_hf_config(arch: str = "llama", **overrides: Any):
    """A transformers config for a tiny `arch` model ("llama", "mistral", "qwen2", "qwen3");
    `overrides` replace the defaults (hidden 64, 2 layers, 4 heads / 2 KV heads of 16, vocab 320)."""
    import transformers

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {sorted(TINY_ARCHS)}")
    config_cls_name, architecture = TINY_ARCHS[arch]
    kwargs = {**_TINY_DEFAULTS, **overrides}
    config = getattr(transformers, config_cls_name)(**kwargs)
    config.architectures = [architecture]
    return config


def make_tiny_model(
    tmp_path: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    name: str | None = None,
    **overrides: Any,
) -> Path:
    """Build a random tiny `arch` model with transformers and save it under `tmp_path`.

    Returns the model directory (config.json, generation_config.json, *.safetensors; sharded
    with an index when `max_shard_size` is given, e.g. "40KB"). Same seed and overrides -> same
    weights. Embeddings ~ N(0, 1); other matrices ~ N(0, 1/fan_in) (unit-variance outputs, so
    attention is far from uniform and logits span a few units); norm weights 1 + N(0, 0.01);
    biases N(0, 0.01).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif param_name.endswith("bias"):
                param.copy_(0.1 * noise)
            elif "embed_tokens" in param_name:
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)  # unit-variance outputs for unit inputs
    out = Path(tmp_path) / (name or f"tiny-{arch}")
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    return out


def load_hf_model(path: Path):
    """The transformers model saved at `path`, in float32 eval mode with eager attention."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@dataclass
class StepInputs:
    """The model inputs of one step, and which sequence each logits row belongs to."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # (S,) int64
    row_owner: list[tuple[int, int]]  # per logits row: (sequence id, position)


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)  # every token whose K/V is in the cache
    blocks: list[int] = field(default_factory=list)


class PagedCache:
    """Per-layer K/V caches `(num_blocks, block_size, KVH, D)` and per-sequence block lists.

    Blocks are handed out from a seeded random permutation of the pool, so consecutive blocks of
    one sequence are scattered and interleaved with other sequences'. Block 0 is never handed out
    and is what block-table padding points at. The caches start filled with random values, so a
    read of a slot that was never written changes the result.
    """

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.block_size = block_size
        self.kv_caches = [
            (torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype))
            for _ in range(config.num_hidden_layers)
        ]
        self._free = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
        self.seqs: dict[int, _Seq] = {}

    def tokens(self, seq_id: int) -> list[int]:
        """All tokens of sequence `seq_id` whose K/V are cached."""
        return list(self.seqs[seq_id].tokens)

    def step(self, new_tokens: dict[int, list[int]], all_logits: bool = False) -> StepInputs:
        """Inputs for one step that appends `new_tokens[seq_id]` to each named sequence (new ids
        start a sequence). Logits rows: the last new token of each sequence, or every new token
        when `all_logits`. Grows block lists as needed; the cache is written when the model runs.
        """
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        rows: list[int] = []
        owners: list[tuple[int, int]] = []
        for seq_id, toks in new_tokens.items():
            if not toks:
                raise ValueError("every sequence in a step needs at least one new token")
            seq = self.seqs.setdefault(seq_id, _Seq())
            start = len(seq.tokens)
            seq.tokens.extend(toks)
            while len(seq.blocks) * self.block_size < len(seq.tokens):
                seq.blocks.append(self._free.pop())
            for i, tok in enumerate(toks):
                pos = start + i
                if all_logits or i == len(toks) - 1:
                    rows.append(len(ids))
                    owners.append((seq_id, pos))
                ids.append(tok)
                positions.append(pos)
                slots.append(seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_start.append(len(ids))
            seq_lens.append(len(seq.tokens))
            tables.append(list(seq.blocks))
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=block_tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32),
            max_query_len=max(b - a for a, b in zip(query_start, query_start[1:])),
            max_seq_len=max(seq_lens),
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            attn=attn,
            logits_indices=torch.tensor(rows, dtype=torch.int64),
            row_owner=owners,
        )


SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if tools %}{{ '<|start_header_id|>tools<|end_header_id|>\\n\\n' }}"
    "{% for tool in tools %}{{ tool | tojson(indent=2) }}\\n{% endfor %}{{ '<|eot_id|>' }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

_WORDS = (
    "the quick brown fox jumps over lazy dog café naïve résumé élève 中文 分词 测试 你好 世界 "
    "emoji 😀 🚀 🎉 👩‍💻 tokens stream paged cache block attention kernel triton é ü ß ø € — "
    "hello world model sampling decode encode Привет мир こんにちは 日本語 한국어"
).split()


def corpus(n_lines: int = 300, seed: int = 0) -> list[str]:
    """Random lines mixing ASCII, accented Latin, CJK, Cyrillic and emoji (multibyte UTF-8)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 14))) for _ in range(n_lines)]


_TRAINED: dict[str, str] = {}


def build_tiny_tokenizer_dir(
    path: Path, *, post_processor: str | None = "bos", add_bos_token: bool | None = None, eos_in_generation: bool = True
) -> Path:
    """Train (once per process) a ~400-token byte-level BPE and write a Llama-3-like model directory.

    `post_processor`: "bos" — tokenizer.json prepends `<|begin_of_text|>` as Llama 3's does;
    "bytelevel" — the plain ByteLevel post-processor (adds nothing); None — no post-processor.
    """
    if "json" not in _TRAINED:
        backend = HFTokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(corpus(), trainer=trainer)
        _TRAINED["json"] = backend.to_str()
    backend = HFTokenizer.from_str(_TRAINED["json"])
    if post_processor == "bos":
        bos = "<|begin_of_text|>"
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, backend.token_to_id(bos))]
        )
    elif post_processor == "bytelevel":
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"content": "<|eot_id|>", "special": True, "__type": "AddedToken"},
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": LLAMA3_TEMPLATE,
    }
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if eos_in_generation:
        eos = [backend.token_to_id("<|end_of_text|>"), backend.token_to_id("<|eot_id|>")]
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return path


def tiny_llama_chat_model(root: Path) -> Path:
    """`root/model`: tiny random Llama weights (vocab 512) + a trained ~400-token tokenizer with a chat template."""
    path = make_tiny_model(root, "llama", vocab_size=512, max_position_embeddings=512, name="model")
    build_tiny_tokenizer_dir(path)
    return path
