"""A stream's text chunks, made from a chunk rendered once around a stand-in for the text (`TextEvents`), are
byte for byte the chunks rendered whole, for any text: quotes, escapes, control characters, the line breaks
that only `sse` escapes, characters outside the BMP, private-use ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helexa.server.formats import ApiFormat, ChatFormat, CompletionFormat
from helexa.server.sse import TextEvents, sse

TEXTS = [
    "",
    "plain",
    ' "quoted" \\ back',
    "line\nbreak\ttab\x00nul\x1f",
    "\x85 \u2028 \u2029 end",
    "é 🦀 \ue000x\ue001",
]


def _format(kind: type[ApiFormat], include_usage: bool, continuous_usage: bool) -> ApiFormat:
    """A formatter with what its chunks read of a request and a run (no engine behind it)."""
    req = SimpleNamespace(stream=True, include_usage=include_usage, continuous_usage=continuous_usage)
    run = SimpleNamespace(
        request_id="chatcmpl-\u2028id",
        new_parser=lambda: None,
        prompt_tokens=7,
        completion_tokens=3,
        cached_tokens=0,
        choices=[SimpleNamespace(index=0), SimpleNamespace(index=2)],
    )
    return kind(req, run, 'tiny "model"', None)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", [ChatFormat, CompletionFormat])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("continuous_usage", [False, True])
def test_text_chunks_are_the_chunks_rendered_whole(
    kind: type[ApiFormat], include_usage: bool, continuous_usage: bool
) -> None:
    fmt = _format(kind, include_usage, continuous_usage)
    for index in (0, 2):
        for text in TEXTS:
            whole = fmt._chunk(index, **fmt._text_content(text))
            assert fmt._text_chunk(index, text) == whole, (index, text)
    assert bool(fmt._text_events) != continuous_usage  # rendered once per choice unless every chunk differs


def test_text_events_refuse_a_render_without_the_text_once() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        TextEvents(lambda text: sse({"a": "no text"}))
    with pytest.raises(ValueError, match="exactly once"):
        TextEvents(lambda text: sse({"a": text, "b": text}))
