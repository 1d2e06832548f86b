"""The tokenizer: `tokenizers` for tokenizer.json, special tokens and EOS ids from the configs.

Encoding follows transformers 5: tokenizer.json's post-processor decides which special tokens
`encode(..., add_special_tokens=True)` adds; only a tokenizer.json without one takes
`add_bos_token` / `add_eos_token` from tokenizer_config.json (as transformers 4.x did). Truncation
and padding are switched off: an inference engine must never cut a prompt. Decoding skips
transformers' `clean_up_tokenization_spaces` (streamed text cannot be cleaned up after the fact).
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from helexa.model.text.byte_pieces import BytePieces, byte_pieces
from helexa.model.text.chat_template import PROBE_CONVERSATION, ChatTemplate, ChatTemplateError

__all__ = ["Tokenizer", "TooManyTokens", "bos_eos_processor"]

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TooManyTokens(ValueError):
    """A text encodes to more tokens than the caller's `max_length` (`count` of them)."""

    def __init__(self, count: int, max_length: int) -> None:
        super().__init__(f"the text is {count} tokens, more than {max_length}")
        self.count, self.max_length = count, max_length


class Tokenizer:
    """Text ↔ token ids for one model, with its special tokens, EOS ids and chat templates (thread-safe;
    build it with `Tokenizer.from_pretrained(path)`)."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str | None],
        eos_token_ids: Iterable[int],
        chat_templates: Mapping[str, ChatTemplate] | None = None,
    ) -> None:
        self.backend = backend  # read it; do not reconfigure it
        self.bos_token, self.eos_token = special_tokens.get("bos_token"), special_tokens.get("eos_token")
        self.unk_token, self.pad_token = special_tokens.get("unk_token"), special_tokens.get("pad_token")
        self.bos_token_id = backend.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = backend.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        for token_id in self.eos_token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"EOS token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        self.chat_templates: dict[str, ChatTemplate] = dict(chat_templates or {})
        self._pieces: dict[bool, BytePieces | None] = {}  # `byte_pieces`, by skip_special_tokens
        self._pieces_lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face style directory: tokenizer.json; tokenizer_config.json's special tokens,
        `added_tokens_decoder`, `add_bos/eos_token` and `chat_template` (a string or `[{"name", "template"}]`);
        chat_template.jinja (the default template); generation_config.json's `eos_token_id` (int or list).
        `FileNotFoundError` without tokenizer.json, `ValueError` for a malformed tokenizer.json (one line: what
        the `tokenizers` library could not read) or malformed configs, `ChatTemplateError`."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 — the library raises a bare Exception with the reason
            reason = " ".join(str(exc).split()) or type(exc).__name__
            where = path / "tokenizer.json"
            raise ValueError(f"{where} is not a tokenizer the tokenizers library can read: {reason}") from None
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(path / "tokenizer_config.json")
        special = {key: _token_content(config.get(key), f"tokenizer_config.json {key}") for key in _SPECIAL_TOKEN_KEYS}
        # Tokens the configs name but tokenizer.json lacks are added as special, as transformers does.
        decoder = config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, Mapping):
            raise ValueError("tokenizer_config.json added_tokens_decoder must be an object")
        missing: dict[str, bool] = {}  # content -> special
        for token_id, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            content = _token_content(entry, f"added_tokens_decoder[{token_id}]")
            if content is not None and backend.token_to_id(content) is None:
                missing[content] = bool(entry.get("special", True)) if isinstance(entry, Mapping) else True
        for content in special.values():
            if content is not None and backend.token_to_id(content) is None:
                missing.setdefault(content, True)
        if missing:
            backend.add_special_tokens([AddedToken(c, special=s, normalized=False) for c, s in missing.items()])
        if backend.post_processor is None:  # then `add_bos_token` / `add_eos_token` decide
            wrap: list[tuple[str, int] | None] = []
            for key in ("bos_token", "eos_token"):
                token = special[key] if config.get(f"add_{key}", False) else None
                token_id = None if token is None else backend.token_to_id(token)  # named tokens were added above
                wrap.append(None if token is None or token_id is None else (token, token_id))
            backend.post_processor = bos_eos_processor(*wrap)
        eos = _read_json(path / "generation_config.json").get("eos_token_id")
        eos_ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in eos_ids):
            raise ValueError(f"generation_config.json eos_token_id must be an int or a list of ints, got {eos!r}")
        eos_id = backend.token_to_id(special["eos_token"]) if special["eos_token"] is not None else None
        eos_ids = eos_ids + ([] if eos_id is None else [eos_id])
        templates = _load_chat_templates(path, config, special)
        return cls(backend, special_tokens=special, eos_token_ids=eos_ids, chat_templates=templates)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (every id `decode` accepts is below it)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of `token` in the vocabulary (added tokens included), or None."""
        return self.backend.token_to_id(token)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (the ones `skip_special_tokens` drops)."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the post-processor adds BOS/EOS as configured.

        With `max_length`, a text of more tokens raises `TooManyTokens` (its count) before any id list is built.
        """
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        # `encode_batch_fast` releases the GIL while it works (`encode` holds it: seconds for a long prompt,
        # during which no other Python thread, the server's event loop included, would run).
        encoding = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        if max_length is not None and len(encoding) > max_length:
            raise TooManyTokens(len(encoding), max_length)
        return encoding.ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token can stand for (its vocabulary string's length,
        which byte-level and byte-fallback vocabularies only ever make longer): a text of more than
        `n * max_token_bytes` bytes always needs more than `n` tokens."""
        return max(len(token.encode("utf-8")) for token in self.backend.get_vocab(with_added_tokens=True))

    def byte_pieces(self, skip_special_tokens: bool = True) -> BytePieces | None:
        """Every token's bytes when this is a byte-level tokenizer (see `helexa.model.text.byte_pieces`: their
        concatenation decodes as `decode` does), else None. Made and proven once per setting (~0.1 s for a
        49k vocabulary), then shared."""
        with self._pieces_lock:
            if skip_special_tokens not in self._pieces:
                self._pieces[skip_special_tokens] = byte_pieces(
                    self.backend, skip_special_tokens, self.special_token_ids
                )
            return self._pieces[skip_special_tokens]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids` (no tokenization-space clean-up); raises ValueError for ids out of range."""
        ids, vocab_size = list(ids), self.vocab_size
        for token_id in ids:
            if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                raise ValueError(f"token id {token_id!r} is outside the vocabulary (size {vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The default chat template, or None when the model ships none."""
        return self.chat_templates.get("default")

    def probe_chat_templates(self) -> None:
        """Render every chat template once on `PROBE_CONVERSATION` (one user message), as a server does at
        load: a template that fails on it fails on every conversation. Raises `ChatTemplateError` naming the
        template, with the template's own error."""
        for name, template in self.chat_templates.items():
            try:
                template.render([dict(m) for m in PROBE_CONVERSATION], add_generation_prompt=True)
            except ChatTemplateError as exc:
                what = f"the {name!r} chat template fails on a one-message conversation"
                raise ChatTemplateError(f"{what}: {exc}") from None

    def template_for(self, tools: bool) -> ChatTemplate | None:
        """The template a conversation renders with: with tools, one named "tool_use" if the model ships
        it, else the default; None when the model has no chat template."""
        return (self.chat_templates.get("tool_use") if tools else None) or self.chat_template

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text of a conversation (with `tools`, a template named "tool_use" is preferred).
        ValueError without a chat template or for malformed messages; ChatTemplateError if it fails."""
        template = self.template_for(bool(tools))
        if template is None:
            raise ValueError("this model has no chat template; use a completion prompt instead")
        return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of `render_chat(messages, **kwargs)`, encoded without adding special tokens (templates
        write `{{ bos_token }}` themselves): transformers' `apply_chat_template(..., tokenize=True)`.

        Message text is always text: a control-token string typed into a message (`<|im_end|>`, a fake
        turn header) is encoded as ordinary tokens, never as the control token; only the template's own
        markers are special. Messages without such strings encode exactly as transformers does.
        """
        added, max_length = self._added_token_strings, kwargs.pop("max_length", None)
        if not any(token in text for text in _message_texts(messages) for token in added):
            return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=False, max_length=max_length)
        # Each control-token string inside a message text is swapped for an unguessable marker before
        # rendering (so the template's own filters still apply to the text around it), then encoded as
        # plain text where its marker landed; everything else is encoded as usual.
        nonce = str(secrets.randbelow(10**16)).zfill(16)  # digits: unchanged by any case filter
        pattern = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))
        found: list[str] = []

        def mark(text: str) -> str:
            def swap(match: re.Match[str]) -> str:
                found.append(match.group(0))
                return f"\ue000{nonce}{len(found) - 1}\ue001"

            return pattern.sub(swap, text)

        rendered = self.render_chat([_map_texts(m, mark) for m in messages], **kwargs)
        ids, pos = [], 0
        for match in re.finditer(f"\ue000{nonce}(\\d+)\ue001", rendered):
            ids += self.encode(rendered[pos : match.start()], add_special_tokens=False)
            ids += self._text_backend.encode_batch_fast([found[int(match.group(1))]], add_special_tokens=False)[0].ids
            pos = match.end()
        return ids + self.encode(rendered[pos:], add_special_tokens=False)

    @functools.cached_property
    def _added_token_strings(self) -> tuple[str, ...]:
        return tuple(t.content for t in self.backend.get_added_tokens_decoder().values() if t.content)

    @functools.cached_property
    def _text_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that encodes added-token strings as plain text."""
        backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend


def _message_texts(messages: Sequence[Mapping[str, Any]]) -> Iterable[str]:
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            yield from (
                part["text"] for part in content if isinstance(part, Mapping) and isinstance(part.get("text"), str)
            )


def _map_texts(message: Mapping[str, Any], fn: Callable[[str], str]) -> dict[str, Any]:
    """`message` with `fn` applied to its content text (a string, or each text part)."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, str):
        out["content"] = fn(content)
    elif isinstance(content, list):
        out["content"] = [
            {**part, "text": fn(part["text"])}
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
            else part
            for part in content
        ]
    return out


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
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


def bos_eos_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """A post-processor wrapping each sequence in `bos` / `eos` (`(token, id)`, or None for none), in
    transformers' layout (the second sequence of a pair, its specials included, has type id 1)."""

    def wrap(seq: str, type_id: int) -> str:
        return " ".join(f"{piece}:{type_id}" for piece in (bos and bos[0], seq, eos and eos[0]) if piece)

    specials = [t for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(
        single=wrap("$A", 0), pair=f"{wrap('$A', 0)} {wrap('$B', 1)}", special_tokens=specials
    )


def _load_chat_templates(
    path: Path, config: Mapping[str, Any], special: Mapping[str, str | None]
) -> dict[str, ChatTemplate]:
    """Named chat templates: tokenizer_config.json's (string or list form), chat_template.jinja as default."""
    raw = config.get("chat_template")
    sources: dict[str, str] = {}
    if isinstance(raw, str):
        sources["default"] = raw
    elif isinstance(raw, list):
        for entry in raw:
            if not isinstance(entry, Mapping) or not all(isinstance(entry.get(k), str) for k in ("name", "template")):
                raise ValueError("tokenizer_config.json chat_template list entries need 'name' and 'template' strings")
            sources[entry["name"]] = entry["template"]
    elif raw is not None:
        raise ValueError("tokenizer_config.json chat_template must be a string or a list of named templates")
    if (path / "chat_template.jinja").is_file():
        sources["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    variables = {key: value for key, value in special.items() if value is not None}
    return {name: ChatTemplate(source, variables) for name, source in sources.items()}
