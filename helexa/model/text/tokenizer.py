"""The tokenizer: `tokenizers` for tokenizer.json, special tokens and EOS ids from the configs.

`Tokenizer.from_pretrained(path)` reads a Hugging Face style directory:
- `tokenizer.json` (required) — the backend `tokenizers.Tokenizer`;
- `tokenizer_config.json` — `bos_token`, `eos_token`, `unk_token`, `pad_token` (a string or an
  AddedToken dict), `added_tokens_decoder`, `add_bos_token` / `add_eos_token`, `chat_template`
  (a string, or a list of `{"name", "template"}`);
- `chat_template.jinja` — when present it is the default chat template (newer transformers save it
  there instead of in tokenizer_config.json);
- `generation_config.json` — `eos_token_id` (an int or a list), added to the EOS ids.

Encoding follows transformers 5: tokenizer.json's post-processor decides which special tokens
`encode(..., add_special_tokens=True)` adds, and `add_bos_token` / `add_eos_token` in
tokenizer_config.json are ignored when it has one. Only a tokenizer.json without a post-processor
takes those flags (transformers 5 would add nothing there; 4.x honoured the flags). Truncation and padding
from tokenizer.json are switched off: an inference engine must never cut a prompt silently.

Decoding does not apply transformers' `clean_up_tokenization_spaces`: streamed text cannot be
cleaned up after the fact, so, as in vLLM, the text is the plain decode everywhere.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from helexa.model.text.chat_template import ChatTemplate

__all__ = ["Tokenizer"]

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _token_content(value: Any, where: str) -> str | None:
    """A special token from a config: a string, an AddedToken dict (`content`), or None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where} must be a string or an object with 'content', got {value!r}")


def _int_list(value: Any, where: str) -> list[int]:
    """`eos_token_id`-style values: an int, a list of ints, or None."""
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ValueError(f"{where} must be an int or a list of ints, got {value!r}")


class Tokenizer:
    """Text ↔ token ids for one model, with its special tokens, EOS ids and chat templates.

    Use `Tokenizer.from_pretrained(path)`. Thread-safe for `encode`/`decode`/`apply_chat_template`.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str | None],
        eos_token_ids: Iterable[int],
        chat_templates: Mapping[str, ChatTemplate] | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token: str | None = special_tokens.get("bos_token")
        self.eos_token: str | None = special_tokens.get("eos_token")
        self.unk_token: str | None = special_tokens.get("unk_token")
        self.pad_token: str | None = special_tokens.get("pad_token")
        self.bos_token_id: int | None = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id: int | None = self.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        for token_id in self.eos_token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"EOS token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        self.chat_templates: dict[str, ChatTemplate] = dict(chat_templates or {})

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        """Load the tokenizer of a Hugging Face style model directory (see the module docstring).

        Raises `FileNotFoundError` without tokenizer.json, `ValueError` for malformed configs, and
        `ChatTemplateError` for a chat template that does not compile.
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(path / "tokenizer_config.json")
        generation_config = _read_json(path / "generation_config.json")

        special = {key: _token_content(config.get(key), f"tokenizer_config.json {key}") for key in _SPECIAL_TOKEN_KEYS}
        # Tokens the configs name but tokenizer.json lacks are added as special, as transformers does.
        decoder = config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, Mapping):
            raise ValueError("tokenizer_config.json added_tokens_decoder must be an object")
        missing: list[AddedToken] = []
        for token_id, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            content = _token_content(entry, f"added_tokens_decoder[{token_id}]")
            if content is not None and backend.token_to_id(content) is None:
                missing.append(AddedToken(content, special=bool(entry.get("special", True)), normalized=False))
        for content in special.values():
            if content is not None and backend.token_to_id(content) is None:
                if all(token.content != content for token in missing):
                    missing.append(AddedToken(content, special=True, normalized=False))
        if missing:
            backend.add_special_tokens(missing)

        if backend.post_processor is None:
            backend.post_processor = _template_processor(
                backend, special, bool(config.get("add_bos_token", False)), bool(config.get("add_eos_token", False))
            )

        eos_ids = _int_list(generation_config.get("eos_token_id"), "generation_config.json eos_token_id")
        if special["eos_token"] is not None:
            eos_ids.append(backend.token_to_id(special["eos_token"]))
        return cls(
            backend,
            special_tokens=special,
            eos_token_ids=eos_ids,
            chat_templates=_load_chat_templates(path, config, special),
        )

    # ------------------------------------------------------------------ vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (every id `decode` accepts is below it)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (read it; do not reconfigure it)."""
        return self._backend

    def token_to_id(self, token: str) -> int | None:
        """The id of `token` in the vocabulary (added tokens included), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of `token_id` (e.g. `Ġhello` in byte-level BPE), or None."""
        return self._backend.id_to_token(token_id)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (the ones `skip_special_tokens` drops)."""
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    # ------------------------------------------------------------------ text ↔ ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the post-processor adds BOS/EOS as configured."""
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids` (no tokenization-space clean-up); raises ValueError for ids out of range."""
        ids = list(ids)
        vocab_size = self.vocab_size
        for token_id in ids:
            if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                raise ValueError(f"token id {token_id!r} is outside the vocabulary (size {vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The default chat template, or None when the model ships none."""
        return self.chat_templates.get("default")

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text of a conversation. With `tools`, a template named "tool_use" is preferred.

        Raises ValueError when the model has no chat template or the messages are malformed, and
        ChatTemplateError (a ValueError) when the template fails.
        """
        template = self.chat_templates.get("tool_use") if tools else None
        template = template or self.chat_template
        if template is None:
            raise ValueError("this model has no chat template; use a completion prompt instead")
        return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of a conversation, equal to transformers' `apply_chat_template(..., tokenize=True)`.

        The rendered text is encoded without adding special tokens: templates that want a BOS write
        `{{ bos_token }}` themselves, so adding one would double it (transformers does the same).
        """
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _template_processor(
    backend: tokenizers.Tokenizer, special: Mapping[str, str | None], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """A post-processor adding BOS / EOS as `add_bos_token` / `add_eos_token` say (transformers' layout)."""
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos = add_bos and bos is not None
    add_eos = add_eos and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    tokens = []
    if add_bos:
        tokens.append((bos, backend.token_to_id(bos)))
    if add_eos:
        tokens.append((eos, backend.token_to_id(eos)))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)


def _load_chat_templates(path: Path, config: Mapping[str, Any], special: Mapping[str, str | None]) -> dict[str, ChatTemplate]:
    """Named chat templates: tokenizer_config.json's (string or list form), chat_template.jinja as default."""
    sources: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        sources["default"] = raw
    elif isinstance(raw, list):
        for entry in raw:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str) or not isinstance(
                entry.get("template"), str
            ):
                raise ValueError("tokenizer_config.json chat_template list entries need 'name' and 'template' strings")
            sources[entry["name"]] = entry["template"]
    elif raw is not None:
        raise ValueError("tokenizer_config.json chat_template must be a string or a list of named templates")
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        sources["default"] = jinja_file.read_text(encoding="utf-8")
    variables = {key: value for key, value in special.items() if value is not None}
    return {name: ChatTemplate(source, variables) for name, source in sources.items()}
