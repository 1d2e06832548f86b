"""Bad input through the real server: property-based fuzzing of every generation route's body; the template sandbox.

Hypothesis builds request bodies for `/v1/chat/completions`, `/v1/completions` and `/v1/responses`
from a valid one by replacing, adding and dropping fields with wrong types, huge and negative
numbers, NaN and infinities, empty and enormous strings, lone surrogates, deeply nested values and
unknown roles; raw bodies add invalid UTF-8 and nesting deeper than any parser's recursion limit.
The server's chat template raises (`raise_exception`) or reaches for Python internals when a
message asks it to. Every answer must be a 200 or a documented 4xx (never a 500), within the
client's timeout, and afterwards no block is reserved or allocated.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helexa.server.sse import sse
from tests.support.servers import DOCUMENTED_ERRORS, RunningServer, serving, wait_for

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
TIMEOUT = httpx.Timeout(10.0, read=30.0)  # no request may hang past this

# Markers a message's content can carry to make the server's chat template misbehave.
EVIL = {
    "RAISE_IT": "{{ raise_exception('the template refuses this conversation') }}",
    "CLASS_OF": "{{ message.__class__ }}",
    "SUBCLASSES": "{{ ().__class__.__base__.__subclasses__() }}",
    "GLOBALS_OF": "{{ raise_exception.__globals__ }}",
    "MRO_OF": "{{ ''.__class__.__mro__[1].__subclasses__()[0] }}",
    "FUNC_CODE": "{{ namespace.__init__.__code__ }}",
}
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    + "".join(
        f"{{% if message['content'] is string and '{k}' in message['content'] %}}{v}{{% endif %}}"
        for k, v in EVIL.items()
    )
    + "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def hostile_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template that raises or reaches for Python internals on the markers in EVIL."""
    path = tmp_path_factory.mktemp("hostile") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(hostile_model_dir: Path) -> Iterator[RunningServer]:
    """Short outputs (a request without max_tokens gets 8), a small max_model_len, a deep queue."""
    with serving(
        hostile_model_dir, num_blocks=128, max_num_seqs=4, max_model_len=256, default_max_tokens=8, max_queue_depth=256
    ) as running:
        yield running


# --------------------------------------------------------------------------- strategies

NUMBERS = st.one_of(
    st.integers(-3, 12),
    st.sampled_from([2**31, 2**63, -(2**63), 2**64 + 1, 10**40, -(10**40)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -1e308, 0.5, -0.0, 1.5]),
)
STRINGS = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["", " ", "\x00", "\ud800", "a\udfffb", "\u202e", "system", "tool", *EVIL]),
    st.builds(lambda c, n: c * n, st.sampled_from(["a", "é", "😀", " "]), st.sampled_from([5_000, 100_000])),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, STRINGS)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(STRINGS, inner, max_size=4)),
    max_leaves=12,
)
ROLES = st.one_of(st.sampled_from(["user", "system", "assistant", "developer", "tool", "wizard", "", "USER"]), JSON)
CONTENT = st.one_of(
    STRINGS,
    JSON,
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": STRINGS}), max_size=3),
)
MESSAGE = st.one_of(st.fixed_dictionaries({"role": ROLES, "content": CONTENT}), JSON)
MESSAGES = st.one_of(st.lists(MESSAGE, max_size=4), JSON)
PROMPT = st.one_of(
    STRINGS,
    st.lists(st.one_of(st.integers(-5, 600), NUMBERS), max_size=8),
    st.lists(STRINGS, max_size=3),
    st.lists(st.lists(st.integers(0, 500), max_size=4), max_size=3),
    JSON,
)

COMMON = {
    "model": STRINGS,
    "max_tokens": NUMBERS,
    "temperature": NUMBERS,
    "top_p": NUMBERS,
    "top_k": NUMBERS,
    "min_p": NUMBERS,
    "n": NUMBERS,
    "seed": NUMBERS,
    "stop": st.one_of(STRINGS, st.lists(STRINGS, max_size=20)),
    "stream": st.one_of(st.booleans(), JSON),
    "stream_options": JSON,
    "presence_penalty": NUMBERS,
    "frequency_penalty": NUMBERS,
    "repetition_penalty": NUMBERS,
    "ignore_eos": JSON,
    "stop_token_ids": st.one_of(st.lists(NUMBERS, max_size=3), JSON),
    "logprobs": st.one_of(st.booleans(), NUMBERS),
}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
# Valid values of the fields agent frameworks combine (constraints, logprobs, bias), and wrong ones.
FORMATS = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"},
                     {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}]),
    JSON,
)  # fmt: skip
TOOL_CHOICES = st.one_of(
    st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]), JSON
)
LOGIT_BIAS = st.one_of(st.dictionaries(st.sampled_from(["0", "5", "49999", "x", "-1"]), NUMBERS, max_size=3), JSON)
FIELDS = {
    "/v1/chat/completions": {
        **COMMON,
        "messages": MESSAGES,
        "max_completion_tokens": NUMBERS,
        "top_logprobs": NUMBERS,
        "tools": st.one_of(st.just([TOOL]), JSON),
        "tool_choice": TOOL_CHOICES,
        "parallel_tool_calls": st.one_of(st.booleans(), JSON),
        "response_format": FORMATS,
        "logit_bias": LOGIT_BIAS,
    },
    "/v1/completions": {**COMMON, "prompt": PROMPT, "echo": JSON, "logit_bias": LOGIT_BIAS},
    "/v1/responses": {
        "model": STRINGS,
        "input": st.one_of(STRINGS, MESSAGES),
        "instructions": STRINGS,
        "max_output_tokens": NUMBERS,
        "temperature": NUMBERS,
        "top_p": NUMBERS,
        "stream": st.booleans(),
    },
}
VALID = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3},
    "/v1/completions": {"prompt": "hello there", "max_tokens": 3},
    "/v1/responses": {"input": "hello there", "max_output_tokens": 3},
}


@st.composite
def bodies(draw: st.DrawFn, route: str) -> dict[str, Any]:
    """A valid body for `route` with some known fields replaced or dropped and unknown ones added."""
    body = dict(VALID[route])
    fields = FIELDS[route]
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=4, unique=True)):
        body[name] = draw(fields[name])
    for name in draw(st.lists(st.sampled_from(sorted(body)), max_size=1)):
        del body[name]
    body.update(draw(st.dictionaries(STRINGS, JSON, max_size=2)))
    if body.get("max_tokens") not in (None, *range(-3, 13)) and route != "/v1/responses":
        body.setdefault("max_completion_tokens", 3)  # keep any valid request short
    return body


def _encode(body: dict[str, Any]) -> bytes:
    # allow_nan: NaN/Infinity literals are what a sloppy client sends; ensure_ascii keeps lone surrogates encodable.
    return json.dumps(body, allow_nan=True).encode()


def _send(url: str, route: str, raw: bytes) -> tuple[int, dict[str, Any] | None, httpx.Headers]:
    """POST `raw`; the status, the error object of a non-200 answer, and the headers. Streams are read to the end."""
    with httpx.stream(
        "POST", url + route, content=raw, headers={"content-type": "application/json"}, timeout=TIMEOUT
    ) as response:
        data = response.read()
    if response.status_code == 200:
        return 200, None, response.headers
    return response.status_code, json.loads(data)["error"], response.headers


def _assert_documented(status: int, error: dict[str, Any] | None, headers: httpx.Headers, what: str) -> None:
    assert status != 500, f"500 for {what}: {error}"
    if status == 200:
        return
    assert set(error) == {"message", "type", "code", "param"} and error["message"], error
    key = (status, error["code"])
    assert key in DOCUMENTED_ERRORS, f"undocumented {key} for {what}: {error}"
    assert ("retry-after" in headers) == DOCUMENTED_ERRORS[key]
    assert "Traceback" not in error["message"]


def _assert_nothing_leaked(server: RunningServer) -> None:
    def idle() -> bool:
        snap = httpx.get(f"{server.url}/v1/admission", timeout=10).json()
        return snap["in_flight"] == 0 and snap["queue_depth"] == 0 and snap["blocks_reserved"] == 0

    assert wait_for(idle, 10)
    snap = httpx.get(f"{server.url}/v1/admission", timeout=10).json()
    assert snap["blocks_in_use"] == 0 and snap["blocks_empty"] + snap["blocks_cached"] == snap["blocks_total"], snap
    server.engine.check_integrity()


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("route", ROUTES)
def test_fuzzed_bodies_never_500_hang_or_leak(server: RunningServer, route: str) -> None:
    statuses: Counter[int] = Counter()

    @settings(
        max_examples=60,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(body=bodies(route))
    def check(body: dict[str, Any]) -> None:
        raw = _encode(body)
        status, error, headers = _send(server.url, route, raw)
        _assert_documented(status, error, headers, f"{route} {raw[:300]!r}")
        statuses[status] += 1

    check()
    assert statuses[200] >= 1 and statuses[400] >= 10, statuses  # both served and refused bodies were drawn
    _assert_nothing_leaked(server)


RAW_BODIES = [
    b'{"prompt": "\xff\xfe bad utf-8", "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}',
    b"\xed\xa0\x80",  # an encoded surrogate: not UTF-8
    b"[" * 100_000 + b"]" * 100_000,  # deeper than any recursion limit
    b'{"messages": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}",
    b'{"prompt": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
    b'{"prompt": "x", "max_tokens": 1e999}',
    b'{"prompt": "x", "max_tokens": NaN, "temperature": -Infinity}',
    b'{"prompt": "x", "max_tokens": 99999999999999999999999999999999999999}',
    b'{"input": "\\ud800\\udc00\\ud800", "max_output_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "a\\udfff"}], "max_tokens": 2}',
    b'{"prompt": "x", "max_tokens": 2, "top_k": 9223372036854775808}',  # once overflowed the sampler: poisoned the node
    b'{"prompt": "x", "max_tokens": 2, "top_k": 2147483648, "stop_token_ids": [18446744073709551617]}',
    b"",
    b"null",
    b'"just a string"',
    b'{"prompt": "x"' + b", " + b'"k": 1, ' * 20_000 + b'"max_tokens": 2}',
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("raw", RAW_BODIES, ids=range(len(RAW_BODIES)))
def test_raw_bodies(server: RunningServer, route: str, raw: bytes) -> None:
    status, error, headers = _send(server.url, route, raw)
    _assert_documented(status, error, headers, f"{route} {raw[:100]!r}")


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("marker", sorted(EVIL))
def test_template_sandbox_fails_the_request_and_keeps_serving(server: RunningServer, route: str, marker: str) -> None:
    """A template reaching for `__class__`, `__subclasses__`, `__globals__`, `__code__` (or raising): 400, then 200."""
    text = f"please {marker} now"
    body = (
        {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
        if route.endswith("completions")
        else {"input": text, "max_output_tokens": 2}
    )
    response = httpx.post(server.url + route, json=body, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["param"] in ("messages", "input")
    assert error["message"].startswith("chat template:")
    assert "<class" not in error["message"] and "subprocess" not in response.text  # nothing of Python's leaked
    if marker != "RAISE_IT":
        assert "not allowed" in error["message"] or "unsafe" in error["message"], error["message"]
    ok = httpx.post(
        server.url + route,
        json={**body, **({"messages": [{"role": "user", "content": "hi"}]} if "messages" in body else {"input": "hi"})},
        timeout=TIMEOUT,
    )
    assert ok.status_code == 200, ok.text
    _assert_nothing_leaked(server)


def test_streamed_line_separators_cannot_split_an_event() -> None:
    """Sampled text may hold U+0085/U+2028/U+2029, which splitlines-based SSE readers (httpx's `iter_lines`)
    take for line breaks; the soak found streams cut mid-JSON this way. Every event must stay on its own line."""
    text = "a\u2028b\x85c\u2029d\x1ce\u00e9\n\rf"
    raw = sse({"choices": [{"delta": {"content": text}}]}, event="x").decode()
    lines = raw.splitlines()
    assert lines[0] == "event: x" and lines[2:] == [""]
    assert json.loads(lines[1].removeprefix("data: "))["choices"][0]["delta"]["content"] == text
