"""Output processing: the finish reason of one sampled token, and its event."""

from __future__ import annotations

import codecs
import random
from pathlib import Path

import pytest

from helexa.admission import Ticket
from helexa.engine.output import append_token, finish_reason
from helexa.engine.sequence import Request, Sequence
from helexa.engine.stream import RequestStream
from helexa.model.sampling import SampleResult, SamplingParams
from helexa.model.text.detokenizer import IncrementalDetokenizer
from helexa.model.text.stopping import StopChecker
from helexa.model.text.tokenizer import Tokenizer
from tests.support.models import build_tiny_tokenizer_dir, corpus


def test_finish_reason() -> None:
    eos = frozenset({2, 7})
    p = SamplingParams(stop_token_ids=[9])
    assert finish_reason(5, 1, 3, p, eos) is None
    assert finish_reason(2, 1, 3, p, eos) == "stop"
    assert finish_reason(9, 1, 3, p, eos) == "stop"
    assert finish_reason(5, 3, 3, p, eos) == "length"
    assert finish_reason(7, 3, 3, p, eos) == "stop"  # stop wins over length on the same token
    ignoring = SamplingParams(stop_token_ids=[9], ignore_eos=True)
    assert finish_reason(2, 1, 3, ignoring, eos) is None
    assert finish_reason(9, 1, 3, ignoring, eos) == "stop"  # explicit stop tokens still stop
    assert finish_reason(2, 3, 3, ignoring, eos) == "length"
    # the limit is the one admission decided, whatever the request's own max_tokens said
    assert finish_reason(5, 3, 3, SamplingParams(max_tokens=None), eos) == "length"


def _sequence(tokenizer, output_limit: int, stop: list[str]) -> Sequence:
    params = SamplingParams(max_tokens=output_limit, stop=stop, ignore_eos=True)
    request = Request("r", [5, 6], params, RequestStream("r"))
    ticket = Ticket(1, 2, output_limit, 1, "r", 0.0, 1.0, 0.0)
    detok = IncrementalDetokenizer(tokenizer, request.prompt)
    return Sequence(request, ticket, list(request.prompt), detok, StopChecker(stop))


def _held_back(piece: bytes) -> bool:
    """True when UTF-8 decoding `piece` alone leaves bytes waiting for the rest of a character."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(piece)
    return bool(decoder.getstate()[0])


@pytest.mark.parametrize("seed", range(4))
def test_append_token_emits_the_same_text_with_or_without_stop_strings(tmp_path: Path, seed: int) -> None:
    """A request without stop strings takes the detokenizer's deltas as they come; one whose stop string never
    occurs goes through the stop checker. Token by token their events are the same (text, finish reason,
    counts), the last one at the length limit releasing a character still incomplete, and the texts add up
    to the tokenizer's decoding of the output."""
    tokenizer = Tokenizer.from_pretrained(build_tiny_tokenizer_dir(tmp_path))
    pieces = tokenizer.byte_pieces()
    assert pieces is not None
    rng = random.Random(seed)
    ids = tokenizer.encode("".join(rng.choice(corpus()) for _ in range(3)))[:40]
    ids.append(next(i for i, piece in enumerate(pieces) if _held_back(piece)))  # ends inside a character
    plain, watched = _sequence(tokenizer, len(ids), []), _sequence(tokenizer, len(ids), ["\x00never"])
    assert not plain.stop_checker.watching and watched.stop_checker.watching
    samples = SampleResult(ids, [None] * len(ids), [None] * len(ids))
    texts = []
    for row in range(len(ids)):
        a, b = append_token(plain, samples, row, frozenset()), append_token(watched, samples, row, frozenset())
        assert a == b
        texts.append(a.text)
    assert a.finish_reason == "length" and a.num_output_tokens == len(ids)
    assert "".join(texts) == tokenizer.decode(ids)
