"""The core channel's encoding: typed values to plain trees and back, framed as `marshal` bytes.

`to_plain` turns a value into a tree of None, bool, int, float, str, bytes, list and dict: a dataclass or
a NamedTuple becomes a dict of its field names (recursively), an enum its value, an exception
`{"__error__": class name, ...}` (`encode_error`). `from_plain(tp, plain)` rebuilds a value of the
annotated type `tp` from such a tree, by the type hints of the dataclass or NamedTuple it names, so a
plain field added to `EngineView`, `EngineCounters`, `SamplingParams` or any type they hold crosses the
process boundary with no code here. A value with no plain form (a tensor, a lock, a function) raises
`TypeError`: nothing is ever pickled. A token event, the value the frames carry most of, crosses as its
compact tuple when it can (`event_to_plain` / `event_from_plain`).

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

from helexa.engine.stream import TokenEvent

__all__ = [
    "ChannelClosed",
    "decode_error",
    "encode_error",
    "event_from_plain",
    "event_to_plain",
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
    if value is None or type(value) in _SCALARS:
        return value
    if type(value) is tuple or type(value) is list:  # exactly: a NamedTuple is a dict of its fields
        return [v if v is None or type(v) in _SCALARS else to_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return to_plain(value.value)
    if isinstance(value, (bool, int, float, str, bytes)):
        return value
    names = _field_names(type(value))
    if names is not None and not isinstance(value, type):
        plain = {}
        for name in names:  # a token event's fields are mostly scalars: those skip the call
            field = getattr(value, name)
            plain[name] = field if field is None or type(field) in _SCALARS else to_plain(field)
        return plain
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {_hashable(to_plain(k)): to_plain(v) for k, v in value.items()}
    if isinstance(value, BaseException):
        return encode_error(value)
    raise TypeError(f"{type(value).__name__} has no plain form to cross the core channel")


_SCALARS = frozenset({bool, int, float, str, bytes})


def event_to_plain(event: TokenEvent) -> Any:
    """A token event's form in the core's frames: its compact tuple (`TokenEvent.compact`, a few times cheaper
    both ways), or its plain tree when it has logprobs or an error. `event_from_plain` reads either."""
    return event.compact() or to_plain(event)


def event_from_plain(plain: Any) -> TokenEvent:
    """The token event `event_to_plain` gave `plain` for (`marshal` keeps a tuple a tuple; a full one is a dict)."""
    return TokenEvent.from_compact(plain) if type(plain) is tuple else from_plain(TokenEvent, plain)


_NAMES: dict[type, tuple[str, ...] | None] = {}


def _field_names(cls: type) -> tuple[str, ...] | None:
    """A dataclass's or NamedTuple's field names (every field, `repr=False` ones included); None for others."""
    try:
        return _NAMES[cls]
    except KeyError:
        pass
    if dataclasses.is_dataclass(cls):
        names: tuple[str, ...] | None = tuple(f.name for f in dataclasses.fields(cls))
    elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
        names = tuple(cls._fields)
    else:
        names = None
    _NAMES[cls] = names
    return names


def from_plain(tp: Any, plain: Any) -> Any:
    """The value of type `tp` that `plain` (from `to_plain`) stands for; raises `TypeError` when it does not fit."""
    return _decoder(tp)(plain)


_DECODERS: dict[Any, Callable[[Any], Any]] = {}


def _decoder(tp: Any) -> Callable[[Any], Any]:
    """The function that rebuilds a `tp` from its plain tree, made once per type (None always passes)."""
    try:
        return _DECODERS[tp]
    except (KeyError, TypeError):
        pass
    build = _make_decoder(tp)

    def decode(plain: Any) -> Any:
        return None if plain is None else build(plain)

    try:
        _DECODERS[tp] = decode
    except TypeError:  # an unhashable annotation: built again each time
        pass
    return decode


def _make_decoder(tp: Any) -> Callable[[Any], Any]:
    if tp is Any or tp is object:
        return lambda plain: plain
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_decoder(args)
    if origin is typing.Literal:
        return lambda plain: plain
    if isinstance(tp, type):
        if issubclass(tp, BaseException):
            return decode_error
        if issubclass(tp, enum.Enum):
            return tp
        if dataclasses.is_dataclass(tp):
            return _dataclass_decoder(tp)
        if issubclass(tp, tuple) and hasattr(tp, "_fields"):
            hints = _hints(tp)
            fields = {name: _decoder(hints.get(name, Any)) for name in tp._fields}
            return lambda plain: tp(**{k: fields[k](v) for k, v in _fields(tp, plain, fields).items()})
        if tp is float:
            return lambda plain: float(_expect(plain, (int, float), tp))
        if tp is Hashable or tp is tuple:
            return _hashable
        if tp in (bool, int, str, bytes, list, dict):
            return lambda plain: _expect(plain, tp, tp)
    if origin in (list, set, frozenset, Sequence, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            items = [_decoder(a) for a in args]
            return lambda plain: tuple(d(v) for d, v in zip(items, _expect(plain, list, tp), strict=True))
        item = _decoder(args[0] if args else Any)
        make = list if origin is list else tuple if origin in (tuple, Sequence) else origin
        return lambda plain: make([item(v) for v in _expect(plain, list, tp)])
    if origin in (dict, Mapping):
        key, val = (_decoder(a) for a in (args if args else (Any, Any)))
        return lambda plain: {key(k): val(v) for k, v in _expect(plain, dict, tp).items()}
    if tp is Hashable:
        return _hashable
    raise TypeError(f"no plain decoding for {tp!r}")


def _expect(plain: Any, kind: Any, tp: Any) -> Any:
    if not isinstance(plain, kind):
        raise TypeError(f"expected {tp}, got {type(plain).__name__}")
    return plain


def _union_decoder(args: tuple[Any, ...]) -> Callable[[Any], Any]:
    options = [a for a in args if a is not type(None)]
    scalars = tuple(o for o in options if isinstance(o, type) and o in _SCALARS)
    decoders = [(o, _decoder(o)) for o in options]

    def decode(plain: Any) -> Any:
        if scalars and isinstance(plain, scalars):  # the option whose shape matches the plain value
            return plain
        errors = []
        for option, decoder in decoders:
            try:
                return decoder(plain)
            except (TypeError, ValueError, KeyError) as exc:
                errors.append(f"{option}: {exc}")
        raise TypeError(f"{plain!r:.80} fits none of {options}: {'; '.join(errors)}")

    return decode


def _dataclass_decoder(tp: type) -> Callable[[Any], Any]:
    hints = _hints(tp)
    fields = {
        f.name: (_decoder(hints.get(f.name, Any)), f.init, _passing(hints.get(f.name, Any)))
        for f in dataclasses.fields(tp)
    }

    def decode(plain: Any) -> Any:
        init, late = {}, []
        for name, value in _fields(tp, plain, fields).items():
            decoder, in_init, passing = fields[name]
            if type(value) not in passing:  # (a scalar of the field's type is taken as it is, without a call)
                value = decoder(value)
            if in_init:
                init[name] = value
            else:
                late.append((name, value))
        obj = tp(**init)
        for name, value in late:
            object.__setattr__(obj, name, value)
        return obj

    return decode


def _passing(tp: Any) -> frozenset[type]:
    """The plain types a field of type `tp` takes unchanged (what its decoder would return as it is): None
    always, and `bool`, `int`, `str` or `bytes` where `tp` names exactly that type, alone or in a union."""
    options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return frozenset({type(None), *(o for o in options if o in (bool, int, str, bytes))})


def _fields(tp: type, plain: Any, known: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(plain, dict):
        raise TypeError(f"expected a dict of {tp.__name__}'s fields, got {type(plain).__name__}")
    if not known.keys() >= plain.keys():
        raise TypeError(f"{tp.__name__} has no fields {sorted(set(plain) - set(known))}")
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
    """`{"__error__": class name, "__builtin__": its nearest builtin class, "message": str(exc), ...}` plus the
    exception's own plain attributes."""
    extra = {k: to_plain(v) for k, v in vars(exc).items() if not k.startswith("_") and _is_plain(v)}
    builtin = next(c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins")
    return {**extra, "__error__": type(exc).__name__, "__builtin__": builtin, "message": str(exc)}


def decode_error(plain: dict[str, Any]) -> BaseException:
    """The exception `encode_error` described: of its own class when registered (or a builtin), else of its
    nearest builtin class (a `ValueError` subclass stays a `ValueError`), its text naming the class; a
    `RuntimeError` when neither is an `Exception`."""
    name, message = plain.get("__error__", "RuntimeError"), plain.get("message", "")
    build = _ERRORS.get(name)
    if build is not None:
        return build(plain)
    builtins = __import__("builtins")
    builtin = getattr(builtins, name, None)
    if isinstance(builtin, type) and issubclass(builtin, Exception):
        return builtin(message)
    base = getattr(builtins, plain.get("__builtin__", "RuntimeError"), None)
    if not (isinstance(base, type) and issubclass(base, Exception)):
        base = RuntimeError
    return base(f"{name}: {message}")


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
