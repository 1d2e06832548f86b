"""Each token's bytes, for tokenizers whose decoder is GPT-2's byte-level one: their text is the UTF-8 decoding
of the concatenated bytes of the tokens, so a stream can be detokenised one token at a time by a UTF-8 decoder
instead of decoding a window of tokens twice per token.

The table is made from the vocabulary and then proven against the tokenizer itself: every token alone, and
random runs of tokens, must decode to exactly what the tokenizer's `decode` gives. Anything else (another
decoder, a library that renders added tokens differently) yields no table, and the caller decodes windows.
"""

from __future__ import annotations

import random
from collections.abc import Collection

import tokenizers
from tokenizers import decoders

__all__ = ["byte_pieces"]

_PROOF_RUNS = 256  # random runs of tokens decoded both ways when a table is made
_PROOF_RUN_LENGTH = 24


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character that stands for each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: b for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in chars.items()}


_CHAR_BYTES = _unicode_to_byte()


def _piece(token: str) -> bytes:
    """The bytes the byte-level decoder gives one token: through the alphabet when every character is in it,
    else the token's own UTF-8 (an added token such as "<|im end|>" with a plain space)."""
    try:
        return bytes(_CHAR_BYTES[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def byte_pieces(
    backend: tokenizers.Tokenizer, skip_special_tokens: bool, special_ids: Collection[int]
) -> tuple[bytes, ...] | None:
    """For a byte-level tokenizer, the bytes of every token id (b"" for the `special_ids` when
    `skip_special_tokens`: `Tokenizer.special_token_ids`), such that for any ids
    `b"".join(pieces[i] for i in ids).decode("utf-8", "replace")` equals `backend.decode(ids,
    skip_special_tokens)`; None for any other tokenizer or when the proof fails (wrong special ids included).
    Costs two decodes per vocabulary entry once (~0.1 s for 49k tokens)."""
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    special = set(special_ids) if skip_special_tokens else set()
    pieces = []
    for i in range(size):
        token = backend.id_to_token(i)
        if token is None:
            return None
        pieces.append(b"" if i in special else _piece(token))
    texts = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=skip_special_tokens)
    if any(piece.decode("utf-8", "replace") != text for piece, text in zip(pieces, texts)):
        return None
    rng = random.Random(size)
    runs = [[rng.randrange(size) for _ in range(_PROOF_RUN_LENGTH)] for _ in range(_PROOF_RUNS)]
    texts = backend.decode_batch(runs, skip_special_tokens=skip_special_tokens)
    if any(b"".join(pieces[i] for i in run).decode("utf-8", "replace") != text for run, text in zip(runs, texts)):
        return None
    return tuple(pieces)
