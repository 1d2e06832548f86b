"""OpenAI request bodies → validated `GenerationRequest`s (pure parsing: no model, no engine).

Every error is 400 `invalid_request` naming the offending `param`. Unknown fields are ignored, as
OpenAI does; a known field of the wrong type or out of range is an error (`bool` never counts as a
number); `null` means "not given" for every optional field.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from helexa.model.sampling import MAX_LOGPROBS
from helexa.model.sampling.closed_schema import close_objects
from helexa.model.sampling.params import MAX_LOGIT_BIAS
from helexa.model.text.chat_template import validate_messages
from helexa.model.tools import ToolSpecError, read_tools, tool_names
from helexa.server.errors import APIError
from helexa.values import is_int

MAX_N = 128  # most choices one request may ask for
MAX_STOP = 16  # most stop strings (OpenAI allows 4; vLLM has no limit)
_JSON = msgspec.json.Decoder()  # untyped: the same Python values as `json.loads`
MAX_JSON_DEPTH = 64  # deepest nesting of arrays/objects in a body (tool schemas need a dozen or so)
MAX_TOOLS = 128  # most tools one request may declare (OpenAI's limit)
MAX_TOP_K = 2**31 - 1  # any k over the vocabulary filters nothing; larger ones would overflow the sampler's tensors


@dataclass(frozen=True)
class GenerationRequest:
    """One validated generation request; `kind` ("chat", "completion" or "response") names its route.

    - `messages` (chat, responses) passed `validate_messages`.
    - `tools`: chat-shaped function tools (`read_tools`), None without; `tool_choice`: "none" (tools are
      neither shown nor parsed), "auto" (shown; calls in the output are parsed), "required" (the output
      must be calls); `tool_name`: with "required", the one function it must call;
      `parallel_tool_calls`: whether a forced output may hold more than one call.
    - `prompts` (completions): each a string or a list of token ids; one choice group per prompt.
    - `max_tokens`: the client's output limit, or None for the engine's default.
    - `sampling`: `SamplingParams` keyword arguments other than `max_tokens`, `seed` and `n`.
    - `seed`: choice i samples with `seed + i`, so choices differ but repeat.
    - `logprobs`: None, or how many top alternatives per token (0: the chosen token's logprob only).
    - `include_usage`: streaming only — a final chunk carries `usage` (`stream_options.include_usage`);
      `continuous_usage`: every chunk carries the usage so far too (vLLM's
      `stream_options.continuous_usage_stats`, which implies `include_usage`).
    - `format_schema`: structured output — the output must be JSON valid under the request's
      `response_format` (chat) or `text.format` (responses) schema (`format_param` names the field);
      None for free text. Parsing never compiles it: `grammar` stays None here and is filled by the
      server's `GrammarCompiler` (off the event loop, within its budgets) from `format_schema` or, with
      tools, from the forced calls (`ToolCalling.constrain`: a forced call wins; under "auto" the answer
      is calls or JSON text valid under `format_schema`, which governs text only).
    - `text_format`: the Responses API's `text.format` as sent (echoed in the response), None without.
    - `logit_bias`: token id → bias in [-100, 100], None without (token ids checked against the
      vocabulary by the server, which knows it).
    - `prompt_cache_key`: the agent session whose cached prefix is retained past this turn; `cache_salt`:
      the tenant boundary — the prefix cache shares blocks only between requests with the same salt.
    """

    kind: str
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "none"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    prompts: list[str | list[int]] = field(default_factory=list)
    instructions: str | None = None
    max_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: int | None = None
    echo: bool = False
    model: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = None
    grammar: str | None = None
    format_schema: dict[str, Any] | bool | None = None
    text_format: dict[str, Any] | None = None
    logit_bias: dict[int, float] | None = None

    @property
    def format_param(self) -> str:
        """The request field that holds its output format: `response_format` (chat), `text.format` (responses)."""
        return "text.format" if self.kind == "response" else "response_format"


def _loads(raw: bytes) -> Any:
    """`json.loads(raw)`, value or exception, in a third of its time on large bodies: msgspec's decoder gives the
    same values for standard JSON (it holds the GIL 2.6 ms for an 8 MB string against 8-15 ms, and the server
    parses such bodies beside the event loop); what it refuses (NaN, a BOM, surrogates, numbers beyond its
    range, and everything invalid) goes to `json.loads`, so what was accepted, and every error, is unchanged."""
    try:
        return _JSON.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return json.loads(raw)


def decode_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; 400 `invalid_request` when it is not valid JSON or not an object.

    Also refused: nesting deeper than `MAX_JSON_DEPTH` arrays/objects (no later recursive walk can exhaust
    the stack), integers of more digits than Python reads from text (4,300), and strings holding a lone
    UTF-16 surrogate (`"\\ud800"` is valid JSON but not Unicode).
    """
    too_deep = f"request body is nested too deeply (limit {MAX_JSON_DEPTH})"
    try:
        body = _loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError("invalid_request", f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError("invalid_request", too_deep) from None
    except ValueError as exc:  # Python's int-from-text limit: a number with more than 4,300 digits
        raise APIError("invalid_request", f"request body has a number too long to read: {exc}") from None
    if not isinstance(body, dict):
        raise APIError("invalid_request", f"request body must be a JSON object, got {type(body).__name__}")
    stack: list[tuple[Any, int]] = [(body, 1)]  # an iterative walk: depth and Unicode of every item
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if item.isascii():  # (no surrogate possible; and no copy of a megabyte string)
                continue
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(
                    "invalid_request",
                    "request body has a string with a lone UTF-16 surrogate "
                    f"(not valid Unicode): {json.dumps(item)[:80]}",
                ) from None
            continue
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        if depth > MAX_JSON_DEPTH:
            raise APIError("invalid_request", too_deep)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (str, dict, list)))
    return body


# --------------------------------------------------------------------------- field readers


def _bad(param: str, expected: str, value: Any) -> APIError:
    return APIError("invalid_request", f"'{param}' must be {expected}, got {json.dumps(value)[:80]}", param=param)


def _get(body: dict[str, Any], name: str, ok: Callable[[Any], bool], expected: str) -> Any:
    """`body[name]`, or None when absent or null; 400 naming `name` when `ok(value)` is false."""
    value = body.get(name)
    if value is not None and not ok(value):
        raise _bad(name, expected, value)
    return value


def _int(body: dict[str, Any], name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name)
    if isinstance(value, float) and value.is_integer():  # JSON writers may send 16.0
        value = int(value)
    if value is not None and not (is_int(value) and (lo is None or lo <= value) and (hi is None or value <= hi)):
        bound = "" if lo is None else f" >= {lo}" if hi is None else f" in [{lo}, {hi}]"
        raise _bad(name, f"an integer{bound}", value)
    return value


def _number(body: dict[str, Any], name: str, lo: float, hi: float = math.inf, lo_open: bool = False) -> float | None:
    value: Any = body.get(name)
    finite = (is_int(value) or isinstance(value, float)) and abs(value) <= sys.float_info.max  # so float() cannot fail
    if value is not None and not (finite and lo <= value <= hi and not (lo_open and value == lo)):
        bound = (
            f"{'>' if lo_open else '>='} {lo:g}" if hi == math.inf else f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
        )
        raise _bad(name, f"a number {bound}", value)
    return None if value is None else float(value)


def _bool(body: dict[str, Any], name: str) -> bool | None:
    return _get(body, name, lambda v: isinstance(v, bool), "a boolean")


def _str(body: dict[str, Any], name: str) -> str | None:
    return _get(body, name, lambda v: isinstance(v, str), "a string")


MAX_CACHE_KEY = 1024  # characters of a prompt_cache_key or cache_salt


def _cache_key(body: dict[str, Any], name: str) -> str | None:
    """`prompt_cache_key` or `cache_salt`: an optional non-empty string of at most `MAX_CACHE_KEY` characters."""
    ok = lambda v: isinstance(v, str) and 0 < len(v) <= MAX_CACHE_KEY  # noqa: E731
    return _get(body, name, ok, f"a non-empty string of at most {MAX_CACHE_KEY} characters")


def _json_format(value: Any, param: str, schema_at: str | None, open_objects: bool) -> dict[str, Any] | bool | None:
    """The JSON schema of an OpenAI output format: `{"type": "text"}` (None), `{"type": "json_object"}`
    (any JSON object) or `{"type": "json_schema", ...}` with its schema at `value[schema_at]["schema"]`
    (chat) or `value["schema"]` (responses, `schema_at` None). The schema's objects are closed
    (`close_objects`) under `"strict": true`, and without it unless `open_objects`
    (`--allow-additional-properties`). 400 naming `param` for anything else. It is not compiled here
    (the server's `GrammarCompiler` does that, off the event loop)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        holder = value.get(schema_at) if schema_at is not None else value
        if not isinstance(holder, dict) or not isinstance(holder.get("schema", {}), (dict, bool)):
            where = f"{schema_at}.schema" if schema_at else "schema"
            raise _bad(param, f"an object whose '{where}' is a JSON schema object", value)
        schema = holder.get("schema", {})
        strict = holder.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad(param, "an object whose 'strict' is a boolean", value)
        if strict or not open_objects:
            schema = close_objects(schema)
    else:
        raise _bad(param, "an object with 'type' 'text', 'json_object' or 'json_schema'", value)
    return schema


@dataclass(frozen=True)
class _Tools:
    tools: list[dict[str, Any]] | None
    choice: str
    name: str | None
    parallel: bool


def _tools(body: dict[str, Any]) -> _Tools:
    """`tools`, `tool_choice` and `parallel_tool_calls`, as OpenAI defines them (chat's nested function
    objects, or the Responses API's flat ones). `tool_choice` defaults to "auto" with tools, "none" without;
    "required" or a named function without tools is a 400, and so are more than `MAX_TOOLS` tools."""
    declared = body.get("tools")
    if isinstance(declared, list) and len(declared) > MAX_TOOLS:
        raise APIError(
            "invalid_request", f"'tools' declares {len(declared)} tools; at most {MAX_TOOLS} are allowed", param="tools"
        )
    try:
        tools = read_tools(body["tools"]) if body.get("tools") is not None else None
    except ToolSpecError as exc:
        raise APIError("invalid_request", str(exc), param=exc.param) from None
    tools = tools or None
    choice: Any = body.get("tool_choice")
    name = None
    if isinstance(choice, dict):
        function = choice.get("function", choice) if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise _bad(
                "tool_choice", "'auto', 'none', 'required' or {'type': 'function', 'function': {'name'}}", choice
            )
        choice = "required"
    elif choice is None:
        choice = "auto" if tools else "none"
    elif choice not in ("auto", "none", "required"):
        raise _bad("tool_choice", "'auto', 'none', 'required' or a function object", choice)
    if choice == "required" and not tools:
        raise APIError("invalid_request", "tool_choice requires 'tools' to declare the functions", param="tool_choice")
    if name is not None and name not in tool_names(tools):
        raise APIError(
            "invalid_request",
            f"tool_choice names the function {name!r}, which 'tools' does not declare",
            param="tool_choice",
        )
    parallel = _bool(body, "parallel_tool_calls")
    return _Tools(tools, choice if tools else "none", name, True if parallel is None else parallel)


def _stop(body: dict[str, Any], name: str) -> tuple[str, ...] | None:
    value = body.get(name)
    stops = [value] if isinstance(value, str) else [] if value is None else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise _bad(name, f"a non-empty string or a list of at most {MAX_STOP} non-empty strings", value)
    return tuple(stops) or None


def _token_ids(body: dict[str, Any], name: str) -> tuple[int, ...] | None:
    def ok(v: Any) -> bool:
        return isinstance(v, list) and all(is_int(t) and t >= 0 for t in v)

    return tuple(_get(body, name, ok, "a list of non-negative token ids") or ()) or None


# Sampling fields chat and completions share (OpenAI's, plus vLLM's top_k, min_p and penalties); responses
# read `temperature` and `top_p` only. Each reader returns None for "not given".
_SAMPLING: dict[str, Callable[[dict[str, Any], str], Any]] = {
    "temperature": lambda body, name: _number(body, name, 0.0, 2.0),
    "top_p": lambda body, name: _number(body, name, 0.0, 1.0, lo_open=True),
    "top_k": lambda body, name: _int(body, name, -1, MAX_TOP_K),
    "min_p": lambda body, name: _number(body, name, 0.0, 1.0),
    "presence_penalty": lambda body, name: _number(body, name, -2.0, 2.0),
    "frequency_penalty": lambda body, name: _number(body, name, -2.0, 2.0),
    "repetition_penalty": lambda body, name: _number(body, name, 0.0, lo_open=True),
    "ignore_eos": _bool,
    "stop": _stop,
    "stop_token_ids": _token_ids,
    "skip_special_tokens": _bool,
    "speculative": _bool,
}


def _sampling(body: dict[str, Any], names: tuple[str, ...] = tuple(_SAMPLING)) -> dict[str, Any]:
    return {name: value for name in names if (value := _SAMPLING[name](body, name)) is not None}


def _seed(body: dict[str, Any]) -> int | None:
    return _int(body, "seed", -(2**63), 2**63 - 1 - MAX_N)


def _stream(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(`stream`, `stream_options.include_usage`, `stream_options.continuous_usage_stats`); the last
    implies the second (usage on every chunk, and on the final one)."""
    stream = bool(_bool(body, "stream"))
    options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object") or {}
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise _bad(f"stream_options.{name}", "a boolean", value)
        flags.append(bool(value))
    include_usage, continuous = flags
    return stream, include_usage or continuous, continuous


def _logit_bias(body: dict[str, Any]) -> dict[int, float] | None:
    """`logit_bias`: an object of token ids (as strings, the way JSON writes them) to numbers in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return None
    expected = f"an object mapping token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
    if not isinstance(value, dict):
        raise _bad("logit_bias", expected, value)
    bias: dict[int, float] = {}
    for key, number in value.items():
        token = key.strip() if isinstance(key, str) else ""
        number_ok = (is_int(number) or isinstance(number, float)) and abs(number) <= MAX_LOGIT_BIAS  # NaN: False
        if not (token.isdigit() and number_ok):
            raise _bad("logit_bias", expected, {key: number})
        bias[int(token)] = float(number)
    return bias or None


# Fields of the OpenAI APIs helexa reads but cannot honour: a request that sets one (to anything but
# null or the value that asks for nothing) is a 400 naming it, never silently ignored.
_REFUSED: dict[str, tuple[tuple[str, Callable[[Any], bool], str], ...]] = {
    "chat": (
        ("functions", lambda v: v == [], "the deprecated 'functions' are not supported; declare 'tools'"),
        ("function_call", lambda v: v == "none", "the deprecated 'function_call' is not supported; use 'tool_choice'"),
        ("audio", lambda v: False, "audio output is not supported"),
        ("modalities", lambda v: v == ["text"], "only the 'text' modality is supported"),
        ("prediction", lambda v: False, "predicted outputs are not supported"),
        ("web_search_options", lambda v: False, "web search is not supported"),
    ),
    "completion": (("suffix", lambda v: v == "", "'suffix' (insertion) is not supported"),),
    "response": (
        ("background", lambda v: v is False, "background responses are not supported: responses are not stored"),
        ("conversation", lambda v: False, "'conversation' is not supported: send the whole conversation as 'input'"),
        ("max_tool_calls", lambda v: False, "'max_tool_calls' is not supported"),
        ("top_logprobs", lambda v: v == 0, "'top_logprobs' is not supported on /v1/responses; use chat completions"),
        (
            "include",
            lambda v: not (isinstance(v, list) and "message.output_text.logprobs" in v),
            "'include' of 'message.output_text.logprobs' is not supported on /v1/responses; use chat completions",
        ),
        ("prompt", lambda v: False, "prompt templates ('prompt') are not supported; send 'input'"),
    ),
}


def _refuse_unapplied(body: dict[str, Any], kind: str) -> None:
    """400 naming the first field of `_REFUSED[kind]` the body sets to something helexa would not honour."""
    for name, harmless, why in _REFUSED[kind]:
        value = body.get(name)
        if value is not None and not harmless(value):
            raise APIError("invalid_request", why, param=name)


# The roles the OpenAI API defines; any other is a 400, as there.
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _messages(value: Any, param: str) -> list[dict[str, Any]]:
    try:
        messages = validate_messages(value)
    except ValueError as exc:
        raise APIError("invalid_request", str(exc), param=param) from None
    for i, message in enumerate(messages):
        if message["role"] not in ROLES:
            raise APIError(
                "invalid_request",
                f"invalid role {json.dumps(message['role'])[:40]} in {param}[{i}]; supported roles: {', '.join(ROLES)}",
                param=f"{param}[{i}].role",
            )
        if message["role"] == "developer":  # OpenAI's newer name for the system role; templates know "system"
            message["role"] = "system"
    return messages


# --------------------------------------------------------------------------- the three routes


def parse_chat(body: dict[str, Any], open_objects: bool = False) -> GenerationRequest:
    """`POST /v1/chat/completions`: `messages` (required), sampling, `logit_bias`, `n`,
    `logprobs`/`top_logprobs`, streaming, tools, `response_format` (`open_objects`: `_json_format`)."""
    _refuse_unapplied(body, "chat")
    if "messages" not in body:
        raise APIError("invalid_request", "'messages' is required", param="messages")
    messages = _messages(body["messages"], "messages")
    max_tokens = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)  # the newer name wins
    want_logprobs = bool(_bool(body, "logprobs"))
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise APIError("invalid_request", "'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    stream, include_usage, continuous_usage = _stream(body)
    tools = _tools(body)
    output_format = _json_format(body.get("response_format"), "response_format", "json_schema", open_objects)
    return GenerationRequest(
        kind="chat",
        messages=messages,
        tools=tools.tools,
        tool_choice=tools.choice,
        tool_name=tools.name,
        parallel_tool_calls=tools.parallel,
        max_tokens=max_tokens,
        sampling=_sampling(body),
        seed=_seed(body),
        n=_int(body, "n", 1, MAX_N) or 1,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        logprobs=(top or 0) if want_logprobs else None,
        model=_str(body, "model"),
        format_schema=output_format,
        logit_bias=_logit_bias(body),
        prompt_cache_key=_cache_key(body, "prompt_cache_key"),
        cache_salt=_cache_key(body, "cache_salt"),
    )


def _prompts(value: Any) -> list[str | list[int]]:
    """OpenAI's four prompt forms: a string, a list of strings, a token list, a list of token lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(is_int(t) for t in value):
            return [list(value)]
        if all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in value):
            return [list(p) for p in value]
    raise _bad(
        "prompt", "a string, a list of strings, a list of token ids or a list of token-id lists (non-empty)", value
    )


def parse_completion(body: dict[str, Any], open_objects: bool = False) -> GenerationRequest:
    """`POST /v1/completions`: `prompt` (required), sampling, `logit_bias`, `n`, `logprobs` (int), `echo`,
    streaming. (`open_objects` is unused: completions take no output format.)"""
    _refuse_unapplied(body, "completion")
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
    stream, include_usage, continuous_usage = _stream(body)
    return GenerationRequest(
        kind="completion",
        prompts=prompts,
        max_tokens=_int(body, "max_tokens", 1),
        sampling=_sampling(body),
        seed=_seed(body),
        n=n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        logprobs=logprobs,
        logit_bias=_logit_bias(body),
        echo=echo,
        model=_str(body, "model"),
        prompt_cache_key=_cache_key(body, "prompt_cache_key"),
        cache_salt=_cache_key(body, "cache_salt"),
    )


def _response_item(item: Any, where: str, messages: list[dict[str, Any]]) -> None:
    """Append the chat message(s) one Responses API `input` item stands for: a message, a
    `function_call` the model made (joined to the assistant turn before it), or a `function_call_output`
    (a `tool` message)."""
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind == "function_call":
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
        if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
            raise _bad(where, "a function_call item with string 'call_id', 'name' and 'arguments'", item)
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        last = messages[-1] if messages else None
        if last is not None and last.get("role") == "assistant" and last.get("_open"):
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call], "_open": True})
        return
    if kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not (isinstance(call_id, str) and isinstance(output, str)):
            raise _bad(where, "a function_call_output item with string 'call_id' and 'output'", item)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        return
    if kind != "message":
        raise APIError(
            "invalid_request",
            f"{where} must be a message, function_call or function_call_output item; other item types are not "
            "supported",
            param=where,
        )
    content = item.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict)
                and part.get("type") in ("input_text", "output_text", "text")
                and isinstance(part.get("text"), str)
            ):
                raise APIError(
                    "invalid_request",
                    f"{where}.content[{j}] must be a text part ({{'type': 'input_text', 'text': ...}})",
                    param=f"{where}.content",
                )
        content = "".join(part["text"] for part in content)
    messages.append({"role": item.get("role"), "content": content, "_open": item.get("role") == "assistant"})


def _response_input(value: Any) -> list[dict[str, Any]]:
    """The Responses API's `input`: a string (one user message) or a list of items (`_response_item`)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input", "a string or a non-empty list of message items", value)
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        _response_item(item, f"input[{i}]", messages)
    return _messages([{k: v for k, v in m.items() if k != "_open"} for m in messages], "input")


def _text_format(
    body: dict[str, Any], open_objects: bool
) -> tuple[dict[str, Any] | bool | None, dict[str, Any] | None]:
    """The Responses API's `text.format` (its `response_format`): (its schema, the format as sent)."""
    text = body.get("text")
    if text is None:
        return None, None
    if not isinstance(text, dict):
        raise _bad("text", "an object", text)
    value = text.get("format")
    return _json_format(value, "text.format", None, open_objects), value if isinstance(value, dict) else None


def parse_response(body: dict[str, Any], open_objects: bool = False) -> GenerationRequest:
    """`POST /v1/responses`: `input` (required), `instructions`, `max_output_tokens`, `temperature`, `top_p`,
    `stream`, tools, `text.format` (`open_objects`: `_json_format`)."""
    _refuse_unapplied(body, "response")
    if body.get("input") is None:
        raise APIError("invalid_request", "'input' is required", param="input")
    if body.get("previous_response_id") is not None:
        raise APIError(
            "invalid_request",
            "'previous_response_id' is not supported: responses are not stored; send the whole conversation as 'input'",
            param="previous_response_id",
        )
    messages = _response_input(body["input"])
    tools = _tools(body)
    output_format, text_format = _text_format(body, open_objects)
    instructions = _str(body, "instructions")
    if instructions:
        messages = [{"role": "system", "content": instructions}, *messages]
    return GenerationRequest(
        kind="response",
        messages=messages,
        tools=tools.tools,
        tool_choice=tools.choice,
        tool_name=tools.name,
        parallel_tool_calls=tools.parallel,
        instructions=instructions,
        sampling=_sampling(body, ("temperature", "top_p", "speculative")),
        max_tokens=_int(body, "max_output_tokens", 1),
        stream=bool(_bool(body, "stream")),
        model=_str(body, "model"),
        format_schema=output_format,
        text_format=text_format,
        prompt_cache_key=_cache_key(body, "prompt_cache_key"),
        cache_salt=_cache_key(body, "cache_salt"),
    )


@dataclass(frozen=True)
class TokenizeRequest:
    """`POST /tokenize` (vLLM's shape): a `prompt` string, or chat `messages` rendered by the chat template
    (with `chat`: the messages, `tools` and `tool_choice` as a chat request would render them)."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    chat: GenerationRequest | None = None


def parse_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    """`prompt` (a string) or `messages` (as chat), not both; `add_special_tokens` (default: true for a prompt,
    false for messages, whose template writes its own); `add_generation_prompt` (messages; default true);
    with messages, `tools` and `tool_choice` as chat reads them (the tools count as the chat route counts them)."""
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise APIError("invalid_request", "give exactly one of 'prompt' and 'messages'", param="prompt")
    prompt = _str(body, "prompt")
    messages = _messages(body["messages"], "messages") if has_messages else None
    special = _bool(body, "add_special_tokens")
    generation = _bool(body, "add_generation_prompt")
    chat = None
    for name in ("tools", "tool_choice"):
        if has_prompt and body.get(name) is not None:
            raise APIError("invalid_request", f"'{name}' applies to 'messages', not to a 'prompt'", param=name)
    if messages is not None:
        tools = _tools(body)
        chat = GenerationRequest(
            kind="chat", messages=messages, tools=tools.tools, tool_choice=tools.choice, tool_name=tools.name
        )
    return TokenizeRequest(
        prompt, messages, has_prompt if special is None else special, True if generation is None else generation, chat
    )


def parse_detokenize(body: dict[str, Any]) -> list[int]:
    """`POST /detokenize`: `tokens`, a list of token ids (required)."""
    if body.get("tokens") is None:
        raise APIError("invalid_request", "'tokens' is required", param="tokens")
    return list(_token_ids(body, "tokens") or ())
