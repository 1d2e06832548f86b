"""Request parsing without a server: every wrong type or out-of-range value is a 400 naming its `param`."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helexa.server.errors import APIError
from helexa.server.protocol import decode_json, parse_chat, parse_completion, parse_response

MESSAGES = [{"role": "user", "content": "hi"}]


def _error(fn, body) -> APIError:
    with pytest.raises(APIError) as info:
        fn(body)
    assert info.value.status == 400 and info.value.code == "invalid_request"
    assert info.value.body()["error"]["type"] == "invalid_request_error"
    return info.value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1), ("temperature", 2.5), ("temperature", "hot"), ("temperature", True),
        ("top_p", 0), ("top_p", 1.01), ("top_k", -2), ("top_k", 1.5), ("min_p", 1.5),
        ("presence_penalty", 3), ("frequency_penalty", -2.01), ("repetition_penalty", 0),
        ("max_tokens", 0), ("max_tokens", "16"), ("max_completion_tokens", -1), ("n", 0), ("n", 129),
        ("seed", "x"), ("seed", 1.5), ("stop", ""), ("stop", [1]), ("stop", ["a"] * 17), ("stream", "yes"),
        ("logprobs", 1), ("stream_options", "x"), ("tools", {"a": 1}), ("ignore_eos", 0), ("stop_token_ids", [-1]),
        ("model", 7),
    ],
)  # fmt: skip
def test_chat_bad_values_name_their_param(field: str, value: object) -> None:
    error = _error(parse_chat, {"messages": MESSAGES, field: value})
    assert error.param == field
    assert field in error.message


@pytest.mark.parametrize(
    "messages",
    [
        None,
        "hi",
        [],
        [{"content": "x"}],
        [{"role": "user", "content": 3}],
        [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
    ],
)
def test_chat_bad_messages(messages: object) -> None:
    body = {} if messages is None else {"messages": messages}
    assert _error(parse_chat, body).param == "messages"


def test_chat_fields_and_unknown_fields_ignored() -> None:
    req = parse_chat(
        {
            "messages": [{"role": "developer", "content": "be brief"}, *MESSAGES],
            "model": "any",
            "max_tokens": 7,
            "max_completion_tokens": 9,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "min_p": 0.1,
            "seed": 3,
            "n": 2,
            "stop": "x",
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "logprobs": True,
            "top_logprobs": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "u1",
            "some_future_field": {"a": [1]},
            "response_format": {"type": "text"},
            "temperature_": "ignored",
        }
    )
    assert req.kind == "chat" and req.messages[0]["role"] == "system"  # developer → system for templates
    assert req.max_tokens == 9  # max_completion_tokens wins over the legacy max_tokens
    assert req.sampling == {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "stop": ("x",),
    }
    assert (req.seed, req.n, req.logprobs, req.stream, req.include_usage) == (3, 2, 4, True, True)


def test_chat_logprob_rules() -> None:
    assert parse_chat({"messages": MESSAGES, "logprobs": True}).logprobs == 0
    assert parse_chat({"messages": MESSAGES, "logprobs": False}).logprobs is None
    assert _error(parse_chat, {"messages": MESSAGES, "top_logprobs": 2}).param == "top_logprobs"
    assert _error(parse_chat, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}).param == "top_logprobs"


def test_null_means_not_given() -> None:
    req = parse_chat({"messages": MESSAGES, "temperature": None, "max_tokens": None, "stop": None, "n": None})
    assert req.sampling == {} and req.max_tokens is None and req.n == 1


def test_completion_prompt_forms() -> None:
    assert parse_completion({"prompt": "a b"}).prompts == ["a b"]
    assert parse_completion({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse_completion({"prompt": [5, 6, 7]}).prompts == [[5, 6, 7]]
    assert parse_completion({"prompt": [[5], [6, 7]]}).prompts == [[5], [6, 7]]
    for bad in ([], [[]], [1, "a"], {"a": 1}, 3, [True]):
        assert _error(parse_completion, {"prompt": bad}).param == "prompt"
    assert _error(parse_completion, {}).param == "prompt"


def test_completion_specific_fields() -> None:
    req = parse_completion({"prompt": "x", "logprobs": 3, "echo": True, "n": 2} | {"echo": False})
    assert (req.logprobs, req.echo, req.n) == (3, False, 2)
    assert _error(parse_completion, {"prompt": "x", "logprobs": 21}).param == "logprobs"
    assert _error(parse_completion, {"prompt": "x", "logprobs": True}).param == "logprobs"
    assert _error(parse_completion, {"prompt": "x", "echo": True, "logprobs": 1}).param == "echo"
    assert _error(parse_completion, {"prompt": "x", "best_of": 3}).param == "best_of"
    assert _error(parse_completion, {"prompt": ["a"] * 5, "n": 30}).param == "n"


def test_response_input_forms() -> None:
    req = parse_response(
        {
            "input": "hello",
            "instructions": "be brief",
            "max_output_tokens": 5,
            "temperature": 0.2,
            "store": True,
            "metadata": {"k": "v"},
        }
    )
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert (req.max_tokens, req.sampling) == (5, {"temperature": 0.2})
    items = [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {"role": "assistant", "content": "c"},
    ]
    assert parse_response({"input": items}).messages == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c"},
    ]
    assert _error(parse_response, {}).param == "input"
    assert _error(parse_response, {"input": []}).param == "input"
    assert _error(parse_response, {"input": [{"type": "function_call"}]}).param == "input[0]"
    assert _error(parse_response, {"input": "x", "max_output_tokens": 0}).param == "max_output_tokens"
    assert _error(parse_response, {"input": "x", "top_p": 2}).param == "top_p"
    assert _error(parse_response, {"input": "x", "previous_response_id": "r"}).param == "previous_response_id"


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b"\xff\xfe", b"null", b'"text"'])
def test_malformed_json(raw: bytes) -> None:
    error = _error(decode_json, raw)
    assert error.param is None


OPEN = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.mark.parametrize("strict", [None, False, True])
@pytest.mark.parametrize("open_objects", [False, True])
def test_format_objects_are_closed_unless_the_server_keeps_them_open(open_objects: bool, strict: bool | None) -> None:
    spec = {"name": "w", "schema": OPEN, **({} if strict is None else {"strict": strict})}
    chat = parse_chat({"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": spec}},
                      open_objects)  # fmt: skip
    response = parse_response({"input": "hi", "text": {"format": {"type": "json_schema", **spec}}}, open_objects)
    closed = bool(strict) or not open_objects  # strict always closes; --allow-additional-properties opens the rest
    for req in (chat, response):
        assert isinstance(req.format_schema, dict)
        assert req.format_schema.get("additionalProperties") is (False if closed else None)
    assert response.text_format == {"type": "json_schema", **spec}  # echoed as sent
    assert OPEN == {"type": "object", "properties": {"city": {"type": "string"}}}  # the request's schema untouched


@pytest.mark.parametrize(
    ("body", "bias"),
    [({"logit_bias": {"5": -100, " 7 ": 2.5}}, {5: -100.0, 7: 2.5}), ({"logit_bias": {}}, None), ({}, None)],
)
def test_logit_bias_is_read_as_token_ids(body: dict, bias: dict | None) -> None:
    assert parse_chat({"messages": MESSAGES, **body}).logit_bias == bias
    assert parse_completion({"prompt": "x", **body}).logit_bias == bias


def test_stream_options_continuous_usage_stats_implies_include_usage() -> None:
    req = parse_chat({"messages": MESSAGES, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert req.continuous_usage and req.include_usage
    assert _error(parse_chat, {"messages": MESSAGES, "stream_options": {"continuous_usage_stats": 1}}).param == (
        "stream_options.continuous_usage_stats"
    )


@pytest.mark.parametrize("bias", [{"5": 10**400}, {"5": float("nan")}, {"5": True}, {"-1": 1}, {"5x": 1}, [5]])
def test_bad_logit_bias_is_a_400(bias: object) -> None:
    assert _error(parse_chat, {"messages": MESSAGES, "logit_bias": bias}).param == "logit_bias"


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(value=_JSON_VALUES, ensure_ascii=st.booleans())
def test_the_body_parser_gives_exactly_what_json_loads_gives(value, ensure_ascii: bool) -> None:
    """The fast path (msgspec) and `json.loads` agree value for value, type for type (floats to the bit)."""
    raw = json.dumps({"v": value}, ensure_ascii=ensure_ascii).encode()
    assert repr(decode_json(raw)) == repr(json.loads(raw))


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": NaN, "b": -Infinity}',  # json.loads reads these; the fast decoder refuses them
        b'\xef\xbb\xbf{"a": 1}',  # a byte-order mark
        b'{"a": 1e400}',  # beyond a double: inf
        b'{"a": ' + b"7" * 400 + b"}",  # an integer beyond 64 bits
    ],
)
def test_what_the_fast_decoder_refuses_json_loads_still_reads(raw: bytes) -> None:
    assert repr(decode_json(raw)) == repr(json.loads(raw))


def test_a_utf8_encoded_surrogate_is_still_refused_as_not_unicode() -> None:
    with pytest.raises(APIError, match="lone UTF-16 surrogate"):
        decode_json(b'{"a": "\xed\xa0\x80"}')
