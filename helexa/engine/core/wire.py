"""The core channel's encoding: typed values to plain trees and back, framed as `marshal` bytes.

`to_plain` turns a value into a tree of None, bool, int, float, str, bytes, list and dict: a dataclass or
a NamedTuple becomes a dict of its field names (recursively), an enum its value, an exception
`{"__error__": class name, ...}` (`encode_error`). `from_plain(tp, plain)` rebuilds a value of the
annotated type `tp` from such a tree, by the type hints of the dataclass or NamedTuple it names, so a
plain field added to `EngineView`, `EngineCounters`, `SamplingParams` or any type they hold crosses the
process boundary with no code here. A value with no plain form (a tensor, a lock, a function) raises
`TypeError`: nothing is ever pickled.

Frames are a 4-byte big-endian length and a `marshal` payload of a plain tree. `marshal` is the
interpreter's own C encoder of plain values: compact and fast (see bench/core_channel.py); both ends are
the same interpreter (the core is started with `sys.executable`) and the channel is a private socket
pair between the server and the core it started, so no outside party ever writes to it.
"""

from __future__ import annotations

import dataclasses
import enum
import marshal
import socket
import struct
import sys
import types
import typing
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

__all__ = [
    "ChannelClosed",
    "decode_error",
    "encode_error",
    "from_plain",
    "read_frame",
    "register_error",
    "to_plain",
    "write_frame",
]

_HEADER = struct.Struct(">I")
_MAX_FRAME = 1 << 30
_ERRORS: dict[str, Callable[[dict[str, Any]], BaseException]] = {}


class ChannelClosed(ConnectionError):
    """The other end of the core channel has gone (its process exited or closed the socket)."""


# ------------------------------------------------------------------ typed values <-> plain trees


def to_plain(value: Any) -> Any:
    """`value` as a plain tree (see the module doc); raises `TypeError` for a value with no plain form."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value.value if isinstance(value, enum.Enum) else value
    if isinstance(value, enum.Enum):
        return to_plain(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        return {name: to_plain(getattr(value, name)) for name in value._fields}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {to_plain(k) if not isinstance(k, (list, tuple)) else tuple(to_plain(k)): to_plain(v)
                for k, v in value.items()}  # fmt: skip
    if isinstance(value, BaseException):
        return encode_error(value)
    raise TypeError(f"{type(value).__name__} has no plain form to cross the core channel")


def from_plain(tp: Any, plain: Any) -> Any:
    """The value of type `tp` that `plain` (from `to_plain`) stands for; raises `TypeError` when it does not fit."""
    if plain is None:
        return None
    if tp is Any or tp is object:
        return plain
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _from_union(typing.get_args(tp), plain)
    if origin is typing.Literal:
        return plain
    if isinstance(tp, type):
        if issubclass(tp, BaseException):
            return decode_error(plain)
        if issubclass(tp, enum.Enum):
            return tp(plain)
        if dataclasses.is_dataclass(tp):
            return _dataclass(tp, plain)
        if issubclass(tp, tuple) and hasattr(tp, "_fields"):
            hints = _hints(tp)
            return tp(**{k: from_plain(hints.get(k, Any), v) for k, v in _fields(tp, plain).items()})
        if tp is float and isinstance(plain, int):
            return float(plain)
        if tp is Hashable or tp is tuple:
            return _hashable(plain)
        if tp in (bool, int, float, str, bytes, list, dict):
            if not isinstance(plain, tp):
                raise TypeError(f"expected {tp.__name__}, got {type(plain).__name__}")
            return plain
    args = typing.get_args(tp)
    if origin in (list, set, frozenset, Sequence, tuple):
        if not isinstance(plain, list):
            raise TypeError(f"expected a list for {tp}, got {type(plain).__name__}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            return tuple(from_plain(a, v) for a, v in zip(args, plain, strict=True))
        item = args[0] if args else Any
        items = [from_plain(item, v) for v in plain]
        return items if origin is list else tuple(items) if origin in (tuple, Sequence) else origin(items)
    if origin in (dict, Mapping):
        key, val = args if args else (Any, Any)
        return {from_plain(key, k): from_plain(val, v) for k, v in plain.items()}
    if tp is Hashable:
        return _hashable(plain)
    raise TypeError(f"no plain decoding for {tp!r}")


def _from_union(args: tuple[Any, ...], plain: Any) -> Any:
    options = [a for a in args if a is not type(None)]
    for option in options:  # the option whose shape matches the plain value
        if isinstance(option, type) and option in (bool, int, float, str, bytes) and isinstance(plain, option):
            return plain
    errors = []
    for option in options:
        try:
            return from_plain(option, plain)
        except (TypeError, ValueError, KeyError) as exc:
            errors.append(f"{option}: {exc}")
    raise TypeError(f"{plain!r:.80} fits none of {options}: {'; '.join(errors)}")


def _dataclass(tp: type, plain: Any) -> Any:
    hints = _hints(tp)
    values = _fields(tp, plain)
    init, late = {}, {}
    for f in dataclasses.fields(tp):
        if f.name in values:
            (init if f.init else late)[f.name] = from_plain(hints.get(f.name, Any), values[f.name])
    obj = tp(**init)
    for name, value in late.items():
        object.__setattr__(obj, name, value)
    return obj


def _fields(tp: type, plain: Any) -> dict[str, Any]:
    if not isinstance(plain, dict):
        raise TypeError(f"expected a dict of {tp.__name__}'s fields, got {type(plain).__name__}")
    names = {f.name for f in dataclasses.fields(tp)} if dataclasses.is_dataclass(tp) else set(tp._fields)
    unknown = set(plain) - names
    if unknown:
        raise TypeError(f"{tp.__name__} has no fields {sorted(unknown)}")
    return plain


def _hashable(plain: Any) -> Any:
    return tuple(_hashable(v) for v in plain) if isinstance(plain, list) else plain


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(tp: type) -> dict[str, Any]:
    """`tp`'s field types, resolved once; a field whose annotation cannot be resolved decodes as `Any`."""
    hints = _HINTS.get(tp)
    if hints is None:
        try:
            hints = typing.get_type_hints(tp)
        except (NameError, TypeError):
            module = vars(sys.modules.get(tp.__module__, types.ModuleType("_")))
            hints = {}
            for klass in reversed(tp.__mro__):
                for name, ann in getattr(klass, "__annotations__", {}).items():
                    try:
                        hints[name] = eval(ann, module) if isinstance(ann, str) else ann  # noqa: S307 (own source)
                    except Exception:
                        hints[name] = Any
        _HINTS[tp] = hints
    return hints


# ------------------------------------------------------------------ exceptions


def register_error(cls: type[BaseException], build: Callable[[dict[str, Any]], BaseException] | None = None) -> None:
    """Let exceptions of `cls` (by class name) cross the channel as themselves; `build` makes one from
    `encode_error`'s dict (default: `cls(message)`)."""
    _ERRORS[cls.__name__] = build or (lambda d: cls(d["message"]))


def encode_error(exc: BaseException) -> dict[str, Any]:
    """`{"__error__": class name, "message": str(exc), ...}` plus the exception's own plain attributes."""
    extra = {k: to_plain(v) for k, v in vars(exc).items() if not k.startswith("_") and _is_plain(v)}
    return {**extra, "__error__": type(exc).__name__, "message": str(exc)}


def decode_error(plain: dict[str, Any]) -> BaseException:
    """The exception `encode_error` described: of its own class when registered (or a builtin), else a
    `RuntimeError` whose text names the class."""
    name, message = plain.get("__error__", "RuntimeError"), plain.get("message", "")
    build = _ERRORS.get(name)
    if build is not None:
        return build(plain)
    builtin = getattr(__import__("builtins"), name, None)
    if isinstance(builtin, type) and issubclass(builtin, Exception):
        return builtin(message)
    return RuntimeError(f"{name}: {message}")


def _is_plain(value: Any) -> bool:
    try:
        to_plain(value)
    except TypeError:
        return False
    return True


# ------------------------------------------------------------------ frames


def write_frame(sock: socket.socket, plain: Any) -> int:
    """Send one plain tree as one frame (blocking until the kernel took it all); returns its size in bytes."""
    payload = marshal.dumps(plain)
    sock.sendall(_HEADER.pack(len(payload)) + payload)
    return len(payload) + _HEADER.size


def read_frame(sock: socket.socket) -> Any:
    """The next frame's plain tree; raises `ChannelClosed` at end of stream."""
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    if size > _MAX_FRAME:
        raise ChannelClosed(f"core channel frame of {size} bytes: the stream is corrupt")
    return marshal.loads(_recv_exactly(sock, size))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ChannelClosed("the core channel closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
