"""Incremental detokenisation for streaming: complete characters only, O(window) per token.

Decoding one token at a time is wrong twice over: a byte-level BPE token can end in the middle of
a multibyte UTF-8 character (é, 中, 😀 span two to four bytes, often split across tokens), and some
decoders (SentencePiece's `▁`, WordPiece's `##`) render a token differently at the start of a
string than after another token. So each step decodes a short window twice: the tokens from
`prefix_offset` to `read_offset` (already emitted), and from `prefix_offset` to the end; the new text
is what the second adds to the first. While the window's text ends in U+FFFD (a character still
incomplete) nothing is emitted and the window grows; once the character completes it is emitted
whole and both offsets move forward, so the window stays a few tokens long.
"""

from __future__ import annotations

from collections.abc import Sequence

from helexa.model.text.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens kept as decoding context, as vLLM does


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas for one sequence.

    Guarantee: after `flush()`, the concatenation of every delta returned by `push` and `flush`
    equals `tokenizer.decode(output_ids, skip_special_tokens=...)` for byte-level BPE tokenizers
    (GPT-2, Llama 3, Qwen, SmolLM). With `prompt_ids`, the last few prompt tokens are decoding
    context only (never emitted); for SentencePiece tokenizers this keeps the leading space of the
    first generated word, which a standalone decode of the output would strip.
    A delta never ends inside a multibyte character; text that is still incomplete is held until
    the next token completes it, or until `flush()` gives it up as U+FFFD at the end.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids or ())[-_PROMPT_CONTEXT:]
        if tokenizer.backend.decode(context, skip_special_tokens=skip_special_tokens).endswith(_REPLACEMENT):
            context = []  # a prompt cut inside a character would merge with the output's first bytes
        self._ids: list[int] = context  # context + output ids (only the window is ever decoded)
        self._num_context = len(context)
        self._prefix_offset = 0  # window start: decoded text before read_offset is already emitted
        self._read_offset = len(context)  # tokens before this are emitted (or are context)
        self._chunks: list[str] = []

    @property
    def output_ids(self) -> list[int]:
        """The generated token ids pushed so far."""
        return self._ids[self._num_context :]

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the deltas)."""
        return "".join(self._chunks)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.backend.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Append one generated token; return the newly completed text ("" while a character is incomplete)."""
        if not isinstance(token_id, int) or not 0 <= token_id < self._tokenizer.vocab_size:
            raise ValueError(f"token id {token_id!r} is outside the vocabulary (size {self._tokenizer.vocab_size})")
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # nothing new, or the last character is not complete yet
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of the sequence: the held-back text, if any (an incomplete character becomes U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if delta:
            self._chunks.append(delta)
        return delta
