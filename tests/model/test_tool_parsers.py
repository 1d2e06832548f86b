"""Tool-call parsers on recorded outputs of each format: whole, streamed split at every character and at
every UTF-8 byte, and malformed calls that must stay text."""

from __future__ import annotations

import codecs
import json
import random

import pytest

from helexa.model.tools import PARSERS, ToolCall, detect_format, parse_all
from helexa.model.tools.parsers import HermesParser, Llama3JsonParser, MistralParser, ToolCallParser

NAMES = frozenset({"get_weather", "search", "noop"})

# (parser, model output, expected content, expected calls as (name, arguments object))
RECORDED = [
    # Qwen 2.5 / Hermes: text, then two calls, each on its own lines
    (
        "hermes",
        'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "unit": "C"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"q": "a <b> & \\"c\\""}}\n</tool_call>',
        "Let me check both.",
        [("get_weather", {"city": "東京", "unit": "C"}), ("search", {"q": 'a <b> & "c"'})],
    ),
    ("hermes", '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>\n', None, [("noop", {})]),
    # arguments as a JSON string (some fine-tunes write them so); the end tag cut by EOS
    ("hermes", '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}', None, [("search", {"q": "x"})]),
    ("hermes", "Plain answer, no tools. 2 < 3 and <tool", "Plain answer, no tools. 2 < 3 and <tool", []),
    # Llama 3.1 JSON, with and without <|python_tag|>, two calls separated by ';'
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "noop", "parameters": {}}',
        None,
        [("get_weather", {"city": "Paris"}), ("noop", {})],
    ),
    ("llama3_json", '  {"name": "search", "arguments": {"q": "naïve"}}\n', None, [("search", {"q": "naïve"})]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    # Mistral: a JSON list after [TOOL_CALLS], and the newer name[ARGS]{...} form
    (
        "mistral",
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}, {"name": "noop", "arguments": {}}]',
        "Sure.",
        [("get_weather", {"city": "Lyon"}), ("noop", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]search[ARGS]{"q": "x;y"}[TOOL_CALLS]noop[ARGS]{}',
        None,
        [("search", {"q": "x;y"}), ("noop", {})],
    ),
]

# Outputs that look like calls but are not valid ones: all text, exactly as written.
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),  # bad JSON
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),  # not a declared tool
    ("hermes", '<tool_call>{"name": "noop", "arguments": [1]}</tool_call>'),  # arguments not an object
    ("hermes", '<tool_call>{"name": "noop", "arguments": {}, "extra": 1}</tool_call>'),  # unknown key
    ("hermes", '<tool_call>{"name": "noop", "argu'),  # cut mid-call (max_tokens)
    ("llama3_json", '{"name": "noop", "parameters": {}} and then some text'),
    ("llama3_json", '{"answer": 42}'),  # JSON, but not a call
    ("llama3_json", "<|python_tag|>print('hi')"),
    ("mistral", '[TOOL_CALLS][{"name": "noop", "arguments": {}'),
    ("mistral", "[TOOL_CALLS]noop"),
]


def _shape(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(parser: ToolCallParser, pieces: list[str]) -> tuple[str | None, list[ToolCall]]:
    items = [item for piece in pieces for item in parser.feed(piece)] + parser.finish()
    content = "".join(i for i in items if isinstance(i, str))
    return content or None, [i for i in items if isinstance(i, ToolCall)]


@pytest.mark.parametrize("fmt, text, content, calls", RECORDED)
def test_recorded_outputs(fmt: str, text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = parse_all(PARSERS[fmt](NAMES), text)
    assert got_content == content and _shape(got_calls) == calls
    ids = [c.id for c in got_calls]
    assert len(set(ids)) == len(ids)
    if fmt == "mistral":
        assert all(len(i) == 9 and i.isalnum() for i in ids)  # what Mistral's templates accept back
    else:
        assert all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("fmt, text, content, calls", RECORDED)
def test_streaming_equals_whole_at_every_split(fmt: str, text: str, content: str | None, calls: list) -> None:
    whole = parse_all(PARSERS[fmt](NAMES), text)
    for cut in range(len(text) + 1):  # two deltas, split at every character
        got = _streamed(PARSERS[fmt](NAMES), [text[:cut], text[cut:]])
        assert (got[0], _shape(got[1])) == (whole[0], _shape(whole[1])), cut
    data = text.encode()
    for cut in range(len(data) + 1):  # bytes decoded as they arrive, as the detokenizer hands them on
        decoder = codecs.getincrementaldecoder("utf-8")()
        pieces = [decoder.decode(data[:cut]), decoder.decode(data[cut:], final=True)]
        got = _streamed(PARSERS[fmt](NAMES), pieces)
        assert (got[0], _shape(got[1])) == (whole[0], _shape(whole[1])), cut
    rng = random.Random(len(text))
    single = _streamed(PARSERS[fmt](NAMES), list(text))  # one character per delta
    assert (single[0], _shape(single[1])) == (whole[0], _shape(whole[1]))
    for _ in range(20):  # random multi-way splits
        cuts = sorted(rng.sample(range(len(text) + 1), min(5, len(text))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        got = _streamed(PARSERS[fmt](NAMES), pieces)
        assert (got[0], _shape(got[1])) == (whole[0], _shape(whole[1]))


@pytest.mark.parametrize("fmt, text", MALFORMED)
def test_malformed_calls_stay_text(fmt: str, text: str) -> None:
    content, calls = parse_all(PARSERS[fmt](NAMES), text)
    assert calls == [] and content == text
    for cut in range(len(text) + 1):
        assert _streamed(PARSERS[fmt](NAMES), [text[:cut], text[cut:]]) == (text, [])


def test_text_streams_as_it_comes_and_only_marker_prefixes_wait() -> None:
    parser = HermesParser(NAMES)
    assert parser.feed("Hello") == ["Hello"]
    assert parser.feed(" wor") == [" wor"]
    assert parser.feed("ld <tool") == ["ld"]  # " <tool" may start a call: held
    assert parser.feed("box>") == [" <toolbox>"]
    assert parser.finish() == []
    assert not parser.made_call


def test_a_call_is_streamed_whole_when_it_closes() -> None:
    parser = HermesParser(NAMES)
    assert parser.feed('<tool_call>\n{"name": "noop", ') == []
    [call] = parser.feed('"arguments": {}}\n</tool_call>')
    assert isinstance(call, ToolCall) and call.name == "noop" and call.arguments == "{}"
    assert parser.made_call
    assert parser.feed("\n") == [] and parser.finish() == []  # whitespace after a call is dropped
    with pytest.raises(RuntimeError):
        parser.feed("more")


def test_rendered_calls_parse_back() -> None:
    calls = [("get_weather", {"city": "Zürich"}), ("noop", {})]
    for parser in (HermesParser, Llama3JsonParser, MistralParser):
        content, parsed = parse_all(parser(NAMES), parser.render_calls(calls))
        assert content is None and _shape(parsed) == calls, parser.name


MARKERS_IN_STRINGS = {"s": '</tool_call> <tool_call> [TOOL_CALLS] [ARGS] <|python_tag|> ; \\" }}', "n": 1}


@pytest.mark.parametrize("parser", [HermesParser, Llama3JsonParser, MistralParser])
def test_a_marker_inside_a_json_string_never_ends_a_call(parser: type[ToolCallParser]) -> None:
    """Every format reads a call's body as JSON: its own markers (and the others') inside an argument's string
    value are part of the value, whole or streamed at any split (issue 31: a forced call came back as text)."""
    calls = [("get_weather", MARKERS_IN_STRINGS), ("noop", {"s": "</tool_call>"})]
    text = parser.render_calls(calls)
    content, parsed = parse_all(parser(NAMES), text)
    assert content is None and _shape(parsed) == calls, (parser.name, content)
    for cut in range(len(text) + 1):
        got = _streamed(parser(NAMES), [text[:cut], text[cut:]])
        assert got[0] is None and _shape(got[1]) == calls, (parser.name, cut)
    assert _shape(_streamed(parser(NAMES), list(text))[1]) == calls


@pytest.mark.parametrize(
    "source, expected",
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),  # no tools: helexa's own rendering
        ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}<tool_call>", "hermes"),
        ("{{ '<|python_tag|>' }}{% for t in tools %}{% endfor %}", "llama3_json"),
        ("{% if message.role == 'ipython' %}{% endif %}", "llama3_json"),
        ("[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral"),
        (None, "hermes"),
    ],
)
def test_format_detected_from_the_template(source: str | None, expected: str) -> None:
    assert detect_format(source) == expected


@pytest.mark.parametrize("parser_type", [HermesParser, Llama3JsonParser, MistralParser])
def test_a_distinct_parser_ends_at_the_first_repeated_call(parser_type: type[ToolCallParser]) -> None:
    calls = [("get_weather", {"city": "Paris", "unit": "C"}), ("search", {"q": "x"})]
    repeat = ("get_weather", {"unit": "C", "city": "Paris"})  # the same call, its keys in another order
    text = parser_type.render_calls([*calls, repeat, ("noop", {})])
    plain = parser_type(NAMES)
    assert len(parse_all(plain, text)[1]) == 4 and not plain.ended  # without `distinct`: every call
    distinct = parser_type(NAMES, distinct=True)
    content, parsed = parse_all(distinct, text)
    assert content is None and _shape(parsed) == calls  # the repeat and all after it are dropped
    assert distinct.ended


def test_a_distinct_parser_says_so_as_soon_as_the_repeat_closes() -> None:
    parser = HermesParser(NAMES, distinct=True)
    one = HermesParser.render_calls([("noop", {})])
    assert len(parser.feed(one)) == 1 and not parser.ended
    assert parser.feed("\n" + one) == [] and parser.ended  # streamed: the engine can stop here
    assert parser.feed("\n" + HermesParser.render_calls([("search", {"q": "y"})])) == [] and parser.finish() == []


def test_a_single_call_parser_ends_at_the_second_call() -> None:
    parser = HermesParser(NAMES, single=True)
    text = "Checking. " + HermesParser.render_calls([("noop", {}), ("search", {"q": "y"})]) + " more"
    content, calls = parse_all(parser, text)
    assert content == "Checking." and _shape(calls) == [("noop", {})] and parser.ended
