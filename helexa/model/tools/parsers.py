"""Tool-call formats: how a model family writes calls, read back from its output text as it streams.

A `ToolCallParser` turns a choice's text deltas into a sequence of items, each a piece of text (the
message content) or a complete `ToolCall`. It is fed every delta (`feed`) and then `finish()`ed; the
items are the same however the text was split into deltas, so a streamed response and a whole one
agree. Text that looks like a call but is not a valid one (bad JSON, a function that was not declared,
an unclosed block that does not parse) stays text, marker and all: nothing is lost and nothing raises.
A call's body is read as JSON: a closing marker inside a JSON string (an argument whose value holds
`</tool_call>` or `[TOOL_CALLS]`) is part of the value and never ends the call.

Whitespace is held back between items: whitespace before a call, and trailing whitespace once any call
was made, is dropped (so `"<tool_call>..</tool_call>\\n"` is a call with no content).

A parser can end an answer at a call it may not hold: with `distinct=True` (the server's parsers) at
the first call identical to an earlier one (same name, same arguments);
with `single=True` (`parallel_tool_calls: false`) at a second call. That call and everything after it
are dropped, and `ended` turns True, so whoever runs the model can stop it there.

Formats (`PARSERS`, chosen per model by `detect_format`, overridden by `--tool-call-parser`):
- `hermes` (Hermes, Qwen 2/2.5/3, and helexa's rendering for templates without tools):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number, after optional text.
- `llama3_json` (Llama 3.1+): the whole output is `{"name": ..., "parameters": {...}}` (or
  `"arguments"`), optionally after `<|python_tag|>`, several separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects, or (newer
  tokenizers) `[TOOL_CALLS]name[ARGS]{...}` per call, after optional text.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from helexa.model.tools.calls import ToolCall, new_call_id

__all__ = [
    "PARSERS",
    "HermesParser",
    "Item",
    "Llama3JsonParser",
    "MistralParser",
    "ToolCallParser",
    "detect_format",
    "parse_all",
]

Item = str | ToolCall  # one parsed piece of a choice's output, in order


class _Emitter:
    """Collects items, holding whitespace back as the module docstring says; nothing from a call that
    ends the answer on (`ended`: a repeat with `distinct`, a second call with `single`)."""

    def __init__(self, distinct: bool = False, single: bool = False) -> None:
        self.items: list[Item] = []
        self._pending = ""  # whitespace not yet emitted
        self.made_call = False
        self.ended = False
        self._distinct, self._single = distinct, single
        self._seen: set[tuple[str, str]] = set()  # (name, arguments with sorted keys) of each call so far

    def text(self, text: str) -> None:
        if self.ended:
            return
        text = self._pending + text
        body = text.rstrip()
        self._pending = text[len(body) :]
        if body:
            self.items.append(body)

    def call(self, call: ToolCall) -> None:
        if self.ended:
            return
        key = (call.name, json.dumps(json.loads(call.arguments), sort_keys=True))
        if (self._single and self.made_call) or (self._distinct and key in self._seen):
            self.ended, self._pending = True, ""
            return
        self._seen.add(key)
        self._pending = ""
        self.made_call = True
        self.items.append(call)

    def finish(self) -> None:
        if self._pending and not self.made_call and not self.ended:
            self.items.append(self._pending)
        self._pending = ""

    def take(self) -> list[Item]:
        items, self.items = self.items, []
        return items


class _JsonScan:
    """Finds a marker outside JSON strings in a growing buffer, scanning each character once: the state
    (inside a string, after a backslash) carries over from one `find` to the next."""

    def __init__(self) -> None:
        self.pos, self._in_string, self._escaped = 0, False, False

    def find(self, buf: str, marker: str) -> int:
        """The index of the first `marker` in `buf` outside any JSON string, or -1 (then the scan resumes
        where it stopped: at the end, or where a marker may still be arriving)."""
        i = self.pos
        while i < len(buf):
            ch = buf[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch == marker[0]:
                if buf.startswith(marker, i):
                    self.pos = i
                    return i
                if marker.startswith(buf[i:]):  # the marker may still be arriving
                    break
            i += 1
        self.pos = i
        return -1


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (it may yet become one)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallParser(ABC):
    """One choice's parser. `tool_names`: the declared functions; a call to any other stays text.
    `distinct`, `single`: end at the first repeat of an identical call, at a second call (module docstring)."""

    name: ClassVar[str]
    id_style: ClassVar[str] = "openai"
    keeps_special_tokens: ClassVar[bool] = False  # its marker is a special token the text must keep

    def __init__(self, tool_names: frozenset[str], distinct: bool = False, single: bool = False) -> None:
        self.tool_names = tool_names
        self._out = _Emitter(distinct, single)
        self._finished = False
        self._buf = ""  # text not yet emitted

    def _text_until(self, marker: str) -> bool:
        """Emit the buffered text before `marker` and drop it and the marker: True. Without `marker` in the
        buffer: emit all but a tail that may still become it, False."""
        at = self._buf.find(marker)
        if at < 0:
            keep = len(self._buf) - _held_prefix(self._buf, marker)
            self._out.text(self._buf[:keep])
            self._buf = self._buf[keep:]
            return False
        self._out.text(self._buf[:at])
        self._buf = self._buf[at + len(marker) :]
        return True

    def feed(self, text: str) -> list[Item]:
        """The items that `text` (the next delta) completes."""
        if self._finished:
            raise RuntimeError("feed after finish")
        if text:
            self._consume(text)
        return self._out.take()

    def finish(self) -> list[Item]:
        """The remaining items once the output has ended (a partial call is parsed as it stands)."""
        if not self._finished:
            self._finished = True
            self._flush()
            self._out.finish()
        return self._out.take()

    @property
    def made_call(self) -> bool:
        """Whether any call was parsed so far."""
        return self._out.made_call

    @property
    def ended(self) -> bool:
        """Whether a call the answer may not hold (a repeat with `distinct`, a second call with `single`)
        ended it: that call and all after it were dropped."""
        return self._out.ended

    @abstractmethod
    def _consume(self, text: str) -> None: ...

    @abstractmethod
    def _flush(self) -> None: ...

    def _call(self, obj: Any, args_key: Sequence[str] = ("arguments", "parameters")) -> ToolCall | None:
        """The call `obj` (a decoded JSON value) stands for, or None when it is not a call to a declared tool."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in self.tool_names:
            return None
        keys = [k for k in args_key if k in obj]
        if len(keys) > 1 or set(obj) - {"name", *keys, "id"}:
            return None
        arguments = obj[keys[0]] if keys else {}
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(new_call_id(self.id_style), obj["name"], json.dumps(arguments, ensure_ascii=False))

    # ---- how the format writes calls (for templates without tool support, and forced calls)

    @classmethod
    @abstractmethod
    def render_calls(cls, calls: Sequence[tuple[str, Any]]) -> str:
        """The text this format's model writes for `calls` ((name, arguments object) pairs)."""

    @classmethod
    @abstractmethod
    def call_grammar(cls, call_json: str, parallel: bool, marker_token: int | None) -> str:
        """Lark rules (llguidance dialect) whose rule `calls` is one or more (`parallel`) calls, each call's
        JSON given by the Lark rule text `call_json` (a `%json {...}` item); the caller adds `start`.
        `marker_token`: the id of the format's marker when the tokenizer has it as a special token."""

    marker: ClassVar[str | None] = None  # the special token the format starts calls with, if any


class HermesParser(ToolCallParser):
    """`<tool_call>` JSON `</tool_call>` blocks."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: frozenset[str], distinct: bool = False, single: bool = False) -> None:
        super().__init__(tool_names, distinct, single)
        self._in_call = False
        self._scan = _JsonScan()  # the open call's body, read as JSON: its closing marker is outside strings

    def _consume(self, text: str) -> None:
        self._buf += text
        while True:
            if not self._in_call:
                if not self._text_until(self.OPEN):
                    return
                self._in_call, self._scan = True, _JsonScan()
            else:
                end = self._scan.find(self._buf, self.CLOSE)
                if end < 0:
                    return
                body, self._buf, self._in_call = self._buf[:end], self._buf[end + len(self.CLOSE) :], False
                self._block(body, closed=True)

    def _block(self, body: str, closed: bool) -> None:
        try:
            call = self._call(json.loads(body))
        except ValueError:
            call = None
        if call is not None:
            self._out.call(call)
        else:
            self._out.text(self.OPEN + body + (self.CLOSE if closed else ""))

    def _flush(self) -> None:
        if self._in_call:
            self._block(self._buf, closed=False)
        else:
            self._out.text(self._buf)
        self._buf, self._in_call = "", False

    @classmethod
    def render_calls(cls, calls: Sequence[tuple[str, Any]]) -> str:
        return "\n".join(
            f"{cls.OPEN}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n{cls.CLOSE}" for n, a in calls
        )

    @classmethod
    def call_grammar(cls, call_json: str, parallel: bool, marker_token: int | None) -> str:
        more = ' ("\\n" call)*' if parallel else ""
        return f'calls: call{more}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: {call_json}\n'


def _decode_sequence(text: str, separator: str) -> list[Any] | None:
    """The JSON values of `text` written one after another with `separator` between them (whitespace
    allowed around each), or None when it is anything else."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return values
        if not text.startswith(separator, pos):
            return None
        pos += len(separator)


class Llama3JsonParser(ToolCallParser):
    """A whole output of JSON calls (`{"name", "parameters"}`), `;`-separated, maybe after `<|python_tag|>`."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def __init__(self, tool_names: frozenset[str], distinct: bool = False, single: bool = False) -> None:
        super().__init__(tool_names, distinct, single)
        self._mode = "undecided"  # then "json" (buffer to the end) or "text" (pass through)

    def _consume(self, text: str) -> None:
        if self._mode == "text":
            self._out.text(text)
            return
        self._buf += text
        head = self._buf.lstrip()
        if not head or (self._mode == "undecided" and self.TAG.startswith(head)):
            return  # still only whitespace, or part of the tag
        if self._mode == "undecided":
            self._mode = "json" if head.startswith(("{", self.TAG)) else "text"
        if self._mode == "text":
            self._out.text(self._buf)
            self._buf = ""

    def _flush(self) -> None:
        body = self._buf.lstrip()
        body = body[len(self.TAG) :] if body.startswith(self.TAG) else body
        values = _decode_sequence(body, ";") if self._mode == "json" else None
        calls = [self._call(v) for v in values or ()]
        if values and all(calls):
            for call in calls:
                assert call is not None
                self._out.call(call)
        else:
            self._out.text(self._buf)
        self._buf = ""

    @classmethod
    def render_calls(cls, calls: Sequence[tuple[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    @classmethod
    def call_grammar(cls, call_json: str, parallel: bool, marker_token: int | None) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"calls: call{more}\ncall: {call_json}\n"


class MistralParser(ToolCallParser):
    """`[TOOL_CALLS]` and a JSON list of calls (or `name[ARGS]{...}` per call), after optional text."""

    name = "mistral"
    id_style = "mistral"
    keeps_special_tokens = True
    marker = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def __init__(self, tool_names: frozenset[str], distinct: bool = False, single: bool = False) -> None:
        super().__init__(tool_names, distinct, single)
        self._in_calls = False

    def _consume(self, text: str) -> None:
        self._buf += text
        assert self.marker is not None
        if not self._in_calls and self._text_until(self.marker):
            self._buf, self._in_calls = self.marker + self._buf, True  # parsed whole at the end, marker and all

    def _flush(self) -> None:
        calls = self._parse(self._buf) if self._in_calls else None
        if calls:
            for call in calls:
                self._out.call(call)
        else:
            self._out.text(self._buf)
        self._buf = ""

    def _parse(self, text: str) -> list[ToolCall] | None:
        """The calls of `text` (from the first marker on), each marker followed by a JSON value (a list of
        calls or one call) or by `name[ARGS]` and a JSON object; the JSON is decoded as JSON, so a marker
        inside one of its strings is part of the value. None when it is anything else."""
        assert self.marker is not None
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(text):
            if not text.startswith(self.marker, pos):
                return None
            pos += len(self.marker)
            while pos < len(text) and text[pos].isspace():
                pos += 1
            try:
                if text.startswith(("[", "{"), pos):
                    value, pos = decoder.raw_decode(text, pos)
                    calls += [self._call(v, ("arguments",)) for v in (value if isinstance(value, list) else [value])]
                else:
                    at = text.find(self.ARGS, pos)
                    if at < 0:
                        return None
                    name, pos = text[pos:at].strip(), at + len(self.ARGS)
                    while pos < len(text) and text[pos].isspace():
                        pos += 1
                    args, pos = decoder.raw_decode(text, pos)
                    calls.append(self._call({"name": name, "arguments": args}))
            except ValueError:
                return None
            while pos < len(text) and text[pos].isspace():
                pos += 1
        if not calls or not all(calls):
            return None
        return [c for c in calls if c is not None]

    @classmethod
    def render_calls(cls, calls: Sequence[tuple[str, Any]]) -> str:
        listed = [{"name": n, "arguments": a} for n, a in calls]
        return f"{cls.marker}{json.dumps(listed, ensure_ascii=False)}"

    @classmethod
    def call_grammar(cls, call_json: str, parallel: bool, marker_token: int | None) -> str:
        marker = f"<[{marker_token}]>" if marker_token is not None else json.dumps(cls.marker)
        more = ' (", " call)*' if parallel else ""
        return f'calls: {marker} "[" call{more} "]"\ncall: {call_json}\n'


PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def detect_format(template_source: str | None) -> str:
    """The parser for a model whose chat template is `template_source`: the format the template writes
    calls in; `hermes` when it names none (helexa then renders tools itself, in that format)."""
    source = template_source or ""
    if "[TOOL_CALLS]" in source:
        return MistralParser.name
    if "<tool_call>" in source:
        return HermesParser.name
    if "<|python_tag|>" in source or "ipython" in source:
        return Llama3JsonParser.name
    return HermesParser.name


def parse_all(parser: ToolCallParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output: (its content, None when empty; its calls), through a fresh `parser`."""
    items = [*parser.feed(text), *parser.finish()]
    content = "".join(i for i in items if isinstance(i, str))
    return content or None, [i for i in items if isinstance(i, ToolCall)]
