"""Chat templates: untrusted Hugging Face Jinja templates, rendered in a sandbox as transformers does.

The jinja2 `ImmutableSandboxedEnvironment` is set up like transformers' (`trim_blocks`, `lstrip_blocks`,
`loopcontrols`, a no-op `{% generation %}`, `raise_exception`, `tojson`, `strftime_now`, `dict`,
`namespace`), so the output matches transformers'. Every failure is a `ChatTemplateError` (a
`ValueError`). Only hostile templates see a difference: an unsafe attribute (`__class__`, any `_name`)
raises at once, and rendering is bounded — `range()` to `MAX_RANGE` items, `*` and `**` to
`_MAX_VALUE_LEN`, output to `max_output_chars`, time to `max_render_seconds` (checked on every step
over a `range`, every call and every output chunk).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

__all__ = ["PROBE_CONVERSATION", "ChatTemplate", "ChatTemplateBroken", "ChatTemplateError", "validate_messages"]

_MAX_VALUE_LEN = 1_000_000  # items/chars a template may build with `*`; digits with `**`


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render. Raised as is when the conversation is to blame: the
    template's own `raise_exception(message)` refused it, or the sandbox refused what it made the template
    do (an unsafe attribute, a value or a render time over the bounds); `ChatTemplateBroken` otherwise."""


class ChatTemplateBroken(ChatTemplateError):
    """A chat template failed for a reason of its own (a type error, an undefined name, a failing filter):
    the fault of whoever serves it, not of the conversation."""


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """What the template's `raise_exception(message)` raises."""


# What a template is rendered on at load: any template that fails on it fails on every conversation.
PROBE_CONVERSATION: tuple[dict[str, str], ...] = ({"role": "user", "content": "hello"},)


def _plain(value: Any, where: str) -> Any:
    """A copy of `value` made only of JSON types (dict with str keys, list, str, int, float, bool, None)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where} has a non-string key {key!r}")
            out[key] = _plain(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise ValueError(f"{where} has unsupported type {type(value).__name__} (expected JSON data)")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """A plain-data copy of an OpenAI-style message list, keys whose value is None dropped (as
    transformers does). Each message needs a non-empty string `role` and a `content` that is a string
    or a list of `{"type": "text", "text": str}` parts (absent only with `tool_calls`, whose
    `function.arguments` come back as objects, decoded from JSON text); `ValueError` names the first
    offending message and field."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of message objects, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages must contain at least one message")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be an object with 'role' and 'content', got {type(message).__name__}")
        message = {key: item for key, item in _plain(message, where).items() if item is not None}
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}.role must be a non-empty string, got {role!r}")
        content = message.get("content")
        if "content" not in message and "tool_calls" not in message:
            raise ValueError(f"{where}.content is required (only a message with tool_calls may omit it)")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError(f"{where}.content[{j}] must be a {{'type': 'text', 'text': ...}} part")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}.content[{j}].text must be a string")
        elif "content" in message and not isinstance(content, str):
            raise ValueError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")
        if "tool_calls" in message:
            message["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        out.append(message)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's `tool_calls`, each `function.arguments` decoded to an object (the OpenAI API
    sends it as JSON text; chat templates, as transformers documents, take the object)."""
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list of tool calls")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}[{j}] must be {{'function': {{'name': ..., 'arguments': ...}}}}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                arguments = None
        if not isinstance(arguments, dict):
            raise ValueError(f"{where}[{j}].function.arguments must be the JSON text of an object")
        function["arguments"] = arguments
    return calls


# (deadline on the monotonic clock, seconds allowed) of the render in progress in this context
_budget: ContextVar[tuple[float, float] | None] = ContextVar("helexa_template_budget", default=None)


def _check_budget() -> None:
    budget = _budget.get()
    if budget is not None and time.monotonic() > budget[0]:
        raise SecurityError(f"chat template rendering exceeded {budget[1]:g} s")


class _BoundedRange(Sequence):
    """`range()` for templates: at most MAX_RANGE items, and iteration checks the render deadline."""

    def __init__(self, *args: int) -> None:
        self._range = range(*args)
        if len(self._range) > MAX_RANGE:
            raise SecurityError(f"range of {len(self._range)} items exceeds the sandbox limit of {MAX_RANGE}")

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index: Any) -> Any:
        item = self._range[index]
        return list(item) if isinstance(item, range) else item

    def __contains__(self, value: object) -> bool:
        return value in self._range

    def _checked(self, items: range) -> Iterator[int]:
        for n, value in enumerate(items):
            if n % 256 == 0:
                _check_budget()
            yield value

    def __iter__(self) -> Iterator[int]:
        return self._checked(self._range)

    def __reversed__(self) -> Iterator[int]:
        return self._checked(self._range[::-1])

    def __repr__(self) -> str:
        return repr(self._range)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a template namespace cannot hold the underscore-prefixed name {name!r}")


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed names (no reaching into Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 — mirrors jinja2's Namespace signature
        attrs = dict(*args[1:], **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(args[0], attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _TemplateDict:
    """`dict(...)` for templates without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Hugging Face semantics: plain json.dumps, no HTML escaping, non-ASCII kept.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with unsafe attribute access as an immediate error and bounded `*`, `**` and calls."""

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed")

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    if len(seq) * max(times, 0) > _MAX_VALUE_LEN:
                        raise SecurityError(f"'*' would build a value of {len(seq) * times} items")
        if operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right * max(abs(left).bit_length(), 1) > 4 * _MAX_VALUE_LEN:
                raise SecurityError(f"'{left} ** {right}' is too large")
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, (str, list, tuple, bytes)) and len(result) > _MAX_VALUE_LEN:
            raise SecurityError(f"'{operator}' built a value of {len(result)} items")
        return result

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_budget()
        return super().call(__context, __obj, *args, **kwargs)


def _iterates_content(ast: jinja2.nodes.Template) -> bool:
    """True when the template loops over a message's `content` (`x.content` or `x["content"]`)."""
    return any(
        getattr(node, "attr", None) == "content" or getattr(getattr(node, "arg", None), "value", None) == "content"
        for loop in ast.find_all(jinja2.nodes.For)
        for node in [loop.iter, *loop.iter.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem))]
    )


class ChatTemplate:
    """A compiled chat template; `render` is thread-safe. `special_tokens` (`{"bos_token": "<s>", ...}`)
    are template variables, as in transformers; keyword arguments to `render` override them."""

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str] | None = None,
        *,
        max_render_seconds: float = 5.0,
        max_output_chars: int = 16_000_000,
    ) -> None:
        if not isinstance(source, str) or not source:
            raise ChatTemplateError("a chat template must be a non-empty string")
        self.source = source
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.max_render_seconds = max_render_seconds
        self.max_output_chars = max_output_chars
        env = _ChatSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(
            raise_exception=_raise_exception,
            strftime_now=lambda fmt: datetime.now().strftime(fmt),
            range=_BoundedRange,
            dict=_TemplateDict(),
            namespace=_Namespace,
        )
        try:
            ast = env.parse(source)
            self._template = env.from_string(ast)
        except Exception as exc:  # noqa: BLE001 — any compile failure is the template's fault
            raise ChatTemplateError(f"chat template does not compile: {type(exc).__name__}: {exc}") from exc
        # Templates that loop over `message.content` get the parts list; the rest get a string.
        self.content_format: str = "parts" if _iterates_content(ast) else "string"
        # Whether the template shows tools itself (reads the `tools` variable).
        self.uses_tools: bool = "tools" in jinja2.meta.find_undeclared_variables(ast)

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars, content_format={self.content_format!r})"

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text of `messages` (see `validate_messages`); text parts are joined with "\\n" unless
        the template loops over `content`. `ValueError` for malformed messages or tools, its subclass
        `ChatTemplateError` when the template refuses the conversation (`raise_exception`, the sandbox's
        bounds), and its subclass `ChatTemplateBroken` when the template fails for any other reason."""
        messages = validate_messages(messages)
        for message in messages:  # a turn with only tool calls has no content: templates get an empty one
            message.setdefault("content", [] if self.content_format == "parts" else "")
        if self.content_format == "string":
            for message in messages:
                if isinstance(message.get("content"), list):
                    message["content"] = "\n".join(part["text"] for part in message["content"])
        if tools is not None:
            if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
                raise ValueError("tools must be a list of objects (JSON schemas)")
            tools = _plain(list(tools), "tools")
        variables = {**self.special_tokens, **_plain(extra, "chat template argument")}
        variables.update(messages=messages, add_generation_prompt=bool(add_generation_prompt), tools=tools)
        token = _budget.set((time.monotonic() + self.max_render_seconds, self.max_render_seconds))
        try:
            chunks: list[str] = []
            size = 0
            for chunk in self._template.generate(**variables):
                size += len(chunk)
                if size > self.max_output_chars:
                    raise SecurityError(f"chat template output exceeds {self.max_output_chars} characters")
                chunks.append(chunk)
                _check_budget()
            return "".join(chunks)
        except (_TemplateRaised, SecurityError) as exc:  # the conversation is refused: its sender's to fix
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 — the template broke: an error for this request only
            raise ChatTemplateBroken(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        finally:
            _budget.reset(token)
