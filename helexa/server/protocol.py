"""OpenAI request bodies → validated, typed requests (no model, no engine: pure parsing).

`parse_chat`, `parse_completion` and `parse_response` each take the decoded JSON body and return a
`GenerationRequest`, or raise `APIError` 400 `invalid_request` naming the offending `param`.
Fields the server does not know are ignored, as OpenAI does; a known field with the wrong type or
an out-of-range value is an error (`bool` is never accepted where a number is expected).
`null` means "not given" for every optional field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from helexa.model.sampling import MAX_LOGPROBS
from helexa.model.text.chat_template import validate_messages
from helexa.server.errors import APIError

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_N",
    "MAX_STOP",
    "MAX_TOP_K",
    "GenerationRequest",
    "decode_json",
    "parse_chat",
    "parse_completion",
    "parse_response",
]

MAX_N = 128  # most choices one request may ask for
MAX_STOP = 16  # most stop strings (OpenAI allows 4; vLLM has no limit)
MAX_JSON_DEPTH = 64  # deepest nesting of arrays/objects in a body (tool schemas need a dozen or so)
MAX_TOP_K = 2**31 - 1  # any k over the vocabulary filters nothing; larger ones would overflow the sampler's tensors
_ROLES_AS_SYSTEM = ("developer",)  # OpenAI's newer name for the system role; chat templates know "system"


@dataclass(frozen=True)
class GenerationRequest:
    """One validated generation request, independent of the route it came from.

    - `kind`: "chat", "completion" or "response" (the route).
    - `messages` (chat and responses): plain-data OpenAI messages, checked by `validate_messages`;
      `tools` (chat) passes through to the chat template.
    - `prompts` (completions): each a string or a list of token ids; one choice group per prompt.
    - `max_tokens`: the client's output limit, or None for the engine's default.
    - `sampling`: keyword arguments for `SamplingParams` other than `max_tokens`, `seed` and `n`.
    - `seed`: choice i of a request samples with `seed + i`, so choices differ but repeat.
    - `logprobs`: None, or how many top alternatives per token (0: the chosen token's logprob only).
    - `include_usage`: streaming only — a final chunk carries `usage` (`stream_options.include_usage`).
    """

    kind: str
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompts: list[str | list[int]] = field(default_factory=list)
    instructions: str | None = None
    max_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    echo: bool = False
    model: str | None = None


def decode_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; 400 `invalid_request` when it is not valid JSON or not an object.

    Also refused: bodies nested deeper than `MAX_JSON_DEPTH` arrays/objects (so no later recursive walk
    of the request can exhaust Python's stack) and strings holding a lone UTF-16 surrogate (`"\\ud800"`
    is valid JSON but no Unicode text; tokenizers reject it).
    """
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError("invalid_request", f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError("invalid_request", f"request body is nested too deeply (limit {MAX_JSON_DEPTH})") from None
    if not isinstance(body, dict):
        raise APIError("invalid_request", f"request body must be a JSON object, got {type(body).__name__}")
    _check_structure(body)
    return body


def _check_structure(body: dict[str, Any]) -> None:
    """Raise 400 for nesting deeper than `MAX_JSON_DEPTH` or a string that is not valid Unicode (iterative walk)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(
                    "invalid_request",
                    "request body has a string with a lone UTF-16 surrogate "
                    f"(not valid Unicode): {json.dumps(item)[:80]}",
                ) from None
            continue
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError("invalid_request", f"request body is nested too deeply (limit {MAX_JSON_DEPTH})")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (str, dict, list)))


# --------------------------------------------------------------------------- field readers


def _bad(param: str, expected: str, value: Any) -> APIError:
    return APIError("invalid_request", f"'{param}' must be {expected}, got {json.dumps(value)[:80]}", param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict[str, Any], name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():  # JSON writers may send 16.0
        value = int(value)
    if hi is not None:
        expected = f"an integer in [{lo}, {hi}]"
    else:
        expected = "an integer" if lo is None else f"an integer >= {lo}"
    if not _is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _bad(name, expected, value)
    return value


def _number(body: dict[str, Any], name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > hi or value < lo or (lo_open and value == lo):
        if math.isinf(hi):
            expected = f"a number {'>' if lo_open else '>='} {lo:g}"
        else:
            expected = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise _bad(name, expected, value)
    return float(value)


def _bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _bad(name, "a boolean", value)
    return value


def _str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(name, "a string", value)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise _bad("stop", f"a non-empty string or a list of at most {MAX_STOP} non-empty strings", value)
    return tuple(stops)


def _token_ids(body: dict[str, Any], name: str) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
        raise _bad(name, "a list of non-negative token ids", value)
    return tuple(value)


def _common(body: dict[str, Any]) -> dict[str, Any]:
    """Sampling fields shared by chat and completions (OpenAI's, plus vLLM's top_k/min_p/penalties)."""
    sampling: dict[str, Any] = {}
    readers = {
        "temperature": lambda: _number(body, "temperature", 0.0, 2.0),
        "top_p": lambda: _number(body, "top_p", 0.0, 1.0, lo_open=True),
        "top_k": lambda: _int(body, "top_k", -1, MAX_TOP_K),
        "min_p": lambda: _number(body, "min_p", 0.0, 1.0),
        "presence_penalty": lambda: _number(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": lambda: _number(body, "frequency_penalty", -2.0, 2.0),
        "repetition_penalty": lambda: _number(body, "repetition_penalty", 0.0, math.inf, lo_open=True),
        "ignore_eos": lambda: _bool(body, "ignore_eos"),
    }
    for name, read in readers.items():
        value = read()
        if value is not None:
            sampling[name] = value
    stop = _stop(body)
    if stop:
        sampling["stop"] = stop
    stop_ids = _token_ids(body, "stop_token_ids")
    if stop_ids:
        sampling["stop_token_ids"] = stop_ids
    return sampling


def _seed(body: dict[str, Any]) -> int | None:
    return _int(body, "seed", -(2**63), 2**63 - 1 - MAX_N)


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """(`stream`, `stream_options.include_usage`)."""
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise _bad("stream_options", "an object", options)
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise _bad("stream_options.include_usage", "a boolean", include_usage)
    return stream, bool(include_usage)


def _messages(value: Any, param: str) -> list[dict[str, Any]]:
    try:
        messages = validate_messages(value)
    except ValueError as exc:
        raise APIError("invalid_request", str(exc), param=param) from None
    for message in messages:
        if message["role"] in _ROLES_AS_SYSTEM:
            message["role"] = "system"
    return messages


# --------------------------------------------------------------------------- the three routes


def parse_chat(body: dict[str, Any]) -> GenerationRequest:
    """`POST /v1/chat/completions`: `messages` (required), sampling, `n`, `logprobs`/`top_logprobs`, streaming."""
    if "messages" not in body:
        raise APIError("invalid_request", "'messages' is required", param="messages")
    messages = _messages(body["messages"], "messages")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise _bad("tools", "a list of tool objects", tools)
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    want_logprobs = bool(_bool(body, "logprobs"))
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise APIError("invalid_request", "'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    stream, include_usage = _stream(body)
    return GenerationRequest(
        kind="chat",
        messages=messages,
        tools=tools or None,
        max_tokens=max_tokens,
        sampling=_common(body),
        seed=_seed(body),
        n=_int(body, "n", 1, MAX_N) or 1,
        stream=stream,
        include_usage=include_usage,
        logprobs=(top or 0) if want_logprobs else None,
        model=_str(body, "model"),
    )


def _prompts(value: Any) -> list[str | list[int]]:
    """OpenAI's four prompt forms: a string, a list of strings, a token list, a list of token lists."""
    expected = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(_is_int(t) for t in value):
            return [list(value)]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in value):
            return [list(p) for p in value]
    raise _bad("prompt", f"{expected} (non-empty)", value)


def parse_completion(body: dict[str, Any]) -> GenerationRequest:
    """`POST /v1/completions`: `prompt` (required), sampling, `n`, `logprobs` (int), `echo`, streaming."""
    if body.get("prompt") is None:
        raise APIError("invalid_request", "'prompt' is required", param="prompt")
    prompts = _prompts(body["prompt"])
    n = _int(body, "n", 1, MAX_N) or 1
    if len(prompts) * n > MAX_N:
        raise APIError("invalid_request", f"{len(prompts)} prompts x n={n} exceeds {MAX_N} choices", param="n")
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of != n:
        raise APIError("invalid_request", "'best_of' other than n is not supported", param="best_of")
    logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    echo = bool(_bool(body, "echo"))
    if echo and logprobs is not None:
        raise APIError("invalid_request", "'echo' with 'logprobs' (prompt logprobs) is not supported", param="echo")
    stream, include_usage = _stream(body)
    return GenerationRequest(
        kind="completion",
        prompts=prompts,
        max_tokens=_int(body, "max_tokens", 1),
        sampling=_common(body),
        seed=_seed(body),
        n=n,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        echo=echo,
        model=_str(body, "model"),
    )


_INPUT_PART_TYPES = ("input_text", "output_text", "text")


def _response_input(value: Any) -> list[dict[str, Any]]:
    """The Responses API's `input`: a string (one user message) or a list of message items."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input", "a string or a non-empty list of message items", value)
    messages = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise APIError(
                "invalid_request",
                f"{where} must be a message item ({{'role', 'content'}}); other item types are not supported",
                param=where,
            )
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") not in _INPUT_PART_TYPES
                    or not isinstance(part.get("text"), str)
                ):
                    raise APIError(
                        "invalid_request",
                        f"{where}.content[{j}] must be a text part ({{'type': 'input_text', 'text': ...}})",
                        param=f"{where}.content",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        messages.append({"role": item.get("role"), "content": content})
    return _messages(messages, "input")


def parse_response(body: dict[str, Any]) -> GenerationRequest:
    """`POST /v1/responses`: `input` (required), `instructions`, `max_output_tokens`, `temperature`, `top_p`,
    `stream`."""
    if body.get("input") is None:
        raise APIError("invalid_request", "'input' is required", param="input")
    if body.get("previous_response_id") is not None:
        raise APIError(
            "invalid_request",
            "'previous_response_id' is not supported: responses are not stored; send the whole conversation as 'input'",
            param="previous_response_id",
        )
    messages = _response_input(body["input"])
    instructions = _str(body, "instructions")
    if instructions:
        messages = [{"role": "system", "content": instructions}, *messages]
    sampling: dict[str, Any] = {}
    for name, value in (
        ("temperature", _number(body, "temperature", 0.0, 2.0)),
        ("top_p", _number(body, "top_p", 0.0, 1.0, lo_open=True)),
    ):
        if value is not None:
            sampling[name] = value
    return GenerationRequest(
        kind="response",
        messages=messages,
        instructions=instructions,
        max_tokens=_int(body, "max_output_tokens", 1),
        sampling=sampling,
        stream=bool(_bool(body, "stream")),
        model=_str(body, "model"),
    )
