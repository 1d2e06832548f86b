"""Incremental detokenisation on a tiny byte-level BPE whose tokens split multibyte characters, both ways: by
each token's bytes (what a byte-level tokenizer gets) and by decoding windows (every other tokenizer)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders

from helexa.model.text import byte_pieces as byte_pieces_module
from helexa.model.text.byte_pieces import BytePieces, byte_pieces
from helexa.model.text.detokenizer import IncrementalDetokenizer
from helexa.model.text.tokenizer import Tokenizer
from tests.support.models import build_tiny_tokenizer_dir, corpus


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer_dir(tmp_path_factory.mktemp("detok"))


@pytest.fixture(scope="module", params=["bytes", "windows"])
def tok(request: pytest.FixtureRequest, tokenizer_dir: Path) -> Tokenizer:
    """The tiny byte-level tokenizer; for "windows" told it has no byte table, as a SentencePiece one has not."""
    tokenizer = Tokenizer.from_pretrained(tokenizer_dir)
    if request.param == "windows":
        tokenizer.byte_pieces = lambda skip_special_tokens=True: None  # type: ignore[method-assign]
    else:
        assert tokenizer.byte_pieces(True) is not None and tokenizer.byte_pieces(False) is not None
    return tokenizer


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


def test_tokens_split_multibyte_characters(tok: Tokenizer) -> None:
    # The fixture must exercise the hard case: some token decodes to an incomplete character.
    ids = tok.encode("😀 🚀 中文 👩‍💻 Привет", add_special_tokens=False)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_match_full_decode(tok: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(1234)
    for trial in range(60):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 8))] if trial % 2 else None
        detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip_special_tokens)
        full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        emitted = ""
        for token_id in ids:
            emitted += detok.push(token_id)
            assert full.startswith(emitted), (ids, emitted)  # nothing emitted is ever revised
        emitted += detok.flush()
        assert emitted == full == detok.text
        assert detok.output_ids == ids


def test_real_text_never_emits_replacement_characters(tok: Tokenizer) -> None:
    for line in corpus(60, seed=7):
        ids = tok.encode(line, add_special_tokens=False)
        prompt = tok.encode("hello 中文", add_special_tokens=True)
        deltas = _stream(IncrementalDetokenizer(tok, prompt_ids=prompt), ids)
        assert all("\ufffd" not in d for d in deltas)
        assert deltas[-1] == ""  # complete text: nothing left for flush
        assert "".join(deltas) == line


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    eot = tok.token_to_id("<|eot_id|>")
    ids = tok.encode("café", add_special_tokens=False) + [eot] + tok.encode(" 中", add_special_tokens=False)
    assert "".join(_stream(IncrementalDetokenizer(tok), ids)) == "café 中"
    assert "".join(_stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids)) == "café<|eot_id|> 中"


def test_incomplete_character_held_then_flushed(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🦊", add_special_tokens=False)  # not in the corpus: byte tokens
    # Find a cut inside the emoji: decoding the prefix ends in U+FFFD.
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    emitted = "".join(detok.push(i) for i in ids[:cut])
    assert "\ufffd" not in emitted
    assert detok.flush() == tok.decode(ids[:cut])[len(emitted) :]  # given up as U+FFFD at the end
    assert detok.flush() == ""


class _CountingTokenizer:
    """Duck-typed Tokenizer recording how many ids each decode call sees; its byte table is `tok`'s."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.vocab_size = tok.vocab_size
        self.backend = self
        self.sizes: list[int] = []

    def byte_pieces(self, skip_special_tokens: bool = True) -> BytePieces | None:
        return self._tok.byte_pieces(skip_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self._tok.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def test_cost_per_token_is_bounded(tok: Tokenizer) -> None:
    """Windows: a few tokens per decode, never the whole sequence. Bytes: no decode at all."""
    ids = tok.encode(" ".join(corpus(40, seed=3)), add_special_tokens=False)
    assert len(ids) > 500
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, prompt_ids=list(range(50)))  # type: ignore[arg-type]
    text = "".join(_stream(detok, ids))
    assert text == tok.decode(ids)
    if tok.byte_pieces() is None:
        assert 0 < max(counting.sizes) <= 8
    else:
        assert counting.sizes == []


def _special(backend: tokenizers.Tokenizer) -> set[int]:
    return {i for i, t in backend.get_added_tokens_decoder().items() if t.special}


def test_byte_pieces_only_for_a_byte_level_decoder(tokenizer_dir: Path) -> None:
    """Another decoder (SentencePiece's Metaspace here) gets no table: its tokens are decoded in windows."""
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert byte_pieces(backend, True, _special(backend)) is not None
    backend.decoder = decoders.Metaspace()
    assert byte_pieces(backend, True, _special(backend)) is None


def test_the_table_holds_each_tokens_bytes(tokenizer_dir: Path) -> None:
    """Token i's bytes are its own, the special tokens' empty when skipped (the last token's too, the table's
    end); a negative index counts from the end, a slice gives a run of pieces, and an id outside is an
    IndexError naming it."""
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    special = _special(backend)
    skipped, kept = byte_pieces(backend, True, special), byte_pieces(backend, False, special)
    assert skipped is not None and kept is not None
    size = backend.get_vocab_size(with_added_tokens=True)
    assert len(skipped) == len(kept) == size and special
    for i in range(size):
        want = byte_pieces_module._piece(backend.id_to_token(i))
        assert kept[i] == want and skipped[i] == (b"" if i in special else want), i
    assert kept[-1] == kept[size - 1] and list(kept[3:7]) == [kept[i] for i in range(3, 7)]
    assert list(kept) == [kept[i] for i in range(size)]
    for bad in (size, -size - 1):
        with pytest.raises(IndexError, match=f"token id {bad} is outside"):
            kept[bad]


def test_byte_pieces_are_proven_against_the_tokenizer(tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table that disagrees with the tokenizer's own decode on one token is not used."""
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    real = byte_pieces_module._piece
    wrong = backend.id_to_token(backend.get_vocab_size() // 2)
    monkeypatch.setattr(byte_pieces_module, "_piece", lambda token: b"?" if token == wrong else real(token))
    assert byte_pieces(backend, True, _special(backend)) is None


def test_rejects_out_of_range_ids(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        detok.push(tok.vocab_size)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        detok.push(-1)
