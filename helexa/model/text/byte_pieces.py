"""Each token's bytes, for tokenizers whose decoder is GPT-2's byte-level one: their text is the UTF-8 decoding
of the concatenated bytes of the tokens, so a stream can be detokenised one token at a time by a UTF-8 decoder
instead of decoding a window of tokens twice per token.

The table is made from the vocabulary and then proven against the tokenizer itself: every token alone, and
random runs of tokens, must decode to exactly what the tokenizer's `decode` gives. Anything else (another
decoder, a library that renders added tokens differently) yields no table, and the caller decodes windows.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Collection, Sequence
from typing import overload

import tokenizers
from tokenizers import decoders

__all__ = ["BytePieces", "byte_pieces"]

_PROOF_RUNS = 256  # random runs of tokens decoded both ways when a table is made
_PROOF_RUN_LENGTH = 24
_PROOF_SLICE = 4096  # tokens decoded alone per call while proving the table


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


class BytePieces(Sequence[bytes]):
    """Every token's bytes, `pieces[i]`, held as one buffer and the end of each token's bytes in it: a 49k
    vocabulary's table is ~0.5 MiB, where a tuple of 49k `bytes` objects held ~7 MiB of the heap (each object's
    header and the allocator's arenas that their making left half full)."""

    def __init__(self, data: bytes, ends: array) -> None:
        self._data, self._ends = data, ends  # token i's bytes: data[ends[i - 1] : ends[i]] (from 0 for i = 0)

    def __len__(self) -> int:
        return len(self._ends)

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[bytes]: ...
    def __getitem__(self, index: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = index + len(self._ends) if index < 0 else index
        if not 0 <= i < len(self._ends):
            raise IndexError(f"token id {index} is outside the table of {len(self._ends)} tokens")
        return self._data[self._ends[i - 1] if i else 0 : self._ends[i]]


def byte_pieces(
    backend: tokenizers.Tokenizer, skip_special_tokens: bool, special_ids: Collection[int]
) -> BytePieces | None:
    """For a byte-level tokenizer, the bytes of every token id (b"" for the `special_ids` when
    `skip_special_tokens`: `Tokenizer.special_token_ids`), such that for any ids
    `b"".join(pieces[i] for i in ids).decode("utf-8", "replace")` equals `backend.decode(ids,
    skip_special_tokens)`; None for any other tokenizer or when the proof fails (wrong special ids included).
    Costs two decodes per vocabulary entry once (~0.1 s for 49k tokens), a slice of the vocabulary at a time, so
    what the proof decodes is freed as it goes."""
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    special = set(special_ids) if skip_special_tokens else set()
    data, ends = bytearray(), array("I")
    for i in range(size):
        token = backend.id_to_token(i)
        if token is None:
            return None
        data += b"" if i in special else _piece(token)
        ends.append(len(data))
    pieces = BytePieces(bytes(data), ends)
    del data
    for start in range(0, size, _PROOF_SLICE):
        ids = range(start, min(size, start + _PROOF_SLICE))
        texts = backend.decode_batch([[i] for i in ids], skip_special_tokens=skip_special_tokens)
        if any(pieces[i].decode("utf-8", "replace") != text for i, text in zip(ids, texts)):
            return None
    rng = random.Random(size)
    runs = [[rng.randrange(size) for _ in range(_PROOF_RUN_LENGTH)] for _ in range(_PROOF_RUNS)]
    texts = backend.decode_batch(runs, skip_special_tokens=skip_special_tokens)
    if any(b"".join(pieces[i] for i in run).decode("utf-8", "replace") != text for run, text in zip(runs, texts)):
        return None
    return pieces
