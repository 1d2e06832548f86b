"""Incremental detokenisation for streaming: complete characters only, O(1) or O(window) per token.

A byte-level BPE token can end inside a multibyte UTF-8 character. For a byte-level tokenizer (GPT-2's
decoder, proven by `Tokenizer.byte_pieces`) each token's bytes go through one incremental UTF-8 decoder:
about 0.3 us a token. Any other tokenizer may render a token differently after another one, so each step
decodes a short window twice — from `prefix_offset` to `read_offset` (already emitted) and to the end — and
emits what the second adds. While that ends in U+FFFD (a character still incomplete) nothing is emitted and
the window grows; then both offsets move.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from helexa.model.text.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens kept as decoding context, as vLLM does


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas.

    After `flush()` the deltas of `push` and `flush` concatenate to `tokenizer.decode(output_ids,
    skip_special_tokens=...)` for byte-level BPE tokenizers. The last few `prompt_ids` are decoding
    context only (for SentencePiece they keep the first word's leading space). A delta never ends
    inside a multibyte character: incomplete text waits for the next token, or `flush()` (as U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._pieces = tokenizer.byte_pieces(skip_special_tokens)  # None: decode windows
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        context = list(prompt_ids or ())[-_PROMPT_CONTEXT:] if self._pieces is None else []  # bytes need none
        if context and tokenizer.backend.decode(context, skip_special_tokens).endswith(_REPLACEMENT):
            context = []  # a prompt cut inside a character would merge with the output's first bytes
        self._ids: list[int] = context  # context + output ids (only the window is ever decoded)
        self._num_context = len(context)
        self._prefix_offset = 0  # window start: decoded text before read_offset is already emitted
        self._read_offset = len(context)  # tokens before this are emitted (or are context)
        self._chunks: list[str] = []

    @property
    def output_ids(self) -> list[int]:  # the generated token ids pushed so far
        return self._ids[self._num_context :]

    @property
    def text(self) -> str:  # all text emitted so far (the concatenation of the deltas)
        return "".join(self._chunks)

    def push(self, token_id: int) -> str:
        """Append one generated token; return the newly completed text ("" while a character is incomplete)."""
        pieces = self._pieces
        if pieces is not None and isinstance(token_id, int) and 0 <= token_id < len(pieces):
            self._ids.append(token_id)
            delta = self._utf8.decode(pieces[token_id])
            if delta:
                self._chunks.append(delta)
            return delta
        if pieces is not None or not isinstance(token_id, int) or not 0 <= token_id < self._tokenizer.vocab_size:
            raise ValueError(f"token id {token_id!r} is outside the vocabulary (size {self._tokenizer.vocab_size})")
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the sequence: the held-back text, if any (an incomplete character becomes U+FFFD)."""
        if self._pieces is not None:
            delta = self._utf8.decode(b"", final=True)
            if delta:
                self._chunks.append(delta)
            return delta
        return self._advance(final=True) if self._read_offset < len(self._ids) else ""

    def _advance(self, final: bool) -> str:
        """The text the unread tokens add to the window; unless `final`, "" while it ends incomplete."""
        window = self._ids[self._prefix_offset :]
        prefix_text = self._tokenizer.backend.decode(window[: self._read_offset - self._prefix_offset], self._skip)
        new_text = self._tokenizer.backend.decode(window, self._skip)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""  # nothing new, or the last character is not complete yet
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if delta:
            self._chunks.append(delta)
        return delta
