"""Table values as bytes: frozen dataclasses ↔ orjson, driven by the dataclasses' type hints.

Faust tables here hold raw bytes (``value_type=bytes``), so Faust never parses anything itself
and a bad changelog record surfaces as one :class:`ValueError` at the call site. The format is
``gearbox.serde``'s; decoding also resolves generic dataclasses such as ``Panes[LaunchSums]``,
which the window states use.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

T = TypeVar("T")

__all__ = ["dumps", "from_plain", "loads"]


# NOTE: a deployment's GearState carries hours of block history (hundreds of samples × blocks),
# which would pass Kafka's 1 MB message limit as plain JSON; big values are zlib-compressed and
# marked with a leading NUL byte, which JSON text never starts with.
COMPRESS_ABOVE_BYTES = 16 * 1024
_ZLIB_MARK = b"\x00"


def dumps(value: object) -> bytes:
    """Serialise a dataclass tree to JSON bytes (compressed when large)."""
    # NOTE: orjson serialises (slotted, frozen) dataclasses natively — enums as values, tuples as
    # lists, exactly what gearbox.serde.to_plain produces — about 10× faster, which matters for
    # a GearState holding hours of block history.
    raw = orjson.dumps(value)
    if len(raw) > COMPRESS_ABOVE_BYTES:
        return _ZLIB_MARK + zlib.compress(raw, 1)
    return raw


def loads(cls: type[T], raw: bytes | bytearray | memoryview | str) -> T:
    """Rebuild a ``cls`` from :func:`dumps` output; ``ValueError`` on anything malformed."""
    try:
        data_bytes = bytes(raw) if isinstance(raw, memoryview | bytearray) else raw
        if isinstance(data_bytes, bytes) and data_bytes.startswith(_ZLIB_MARK):
            data_bytes = zlib.decompress(data_bytes[1:])
        data: Any = orjson.loads(data_bytes)
    except zlib.error as exc:
        raise ValueError(f"{getattr(cls, '__name__', cls)}: bad compressed value ({exc})") from None
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{getattr(cls, '__name__', cls)}: not JSON ({exc})") from None
    value: T = from_plain(cls, data)
    return value


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


Bindings = tuple[tuple[Any, Any], ...]
Decoder = Callable[[object], Any]


def from_plain(hint: Any, data: object, bindings: Bindings = ()) -> Any:
    """Rebuild a value of type ``hint`` from plain JSON data (``ValueError`` when it does not
    fit). ``bindings`` maps type variables of an enclosing generic dataclass to their types."""
    return _decoder(hint, bindings)(data)


def from_plain_hint(hint: Any, bindings: Bindings) -> Any:
    """``hint`` with bound type variables substituted."""
    return dict(bindings).get(hint, hint) if isinstance(hint, TypeVar) else hint


# NOTE: a decoder per (type hint, bindings), built once: resolving hints with typing's
# introspection for every field of every value was most of a table read (the view reader
# decodes every GPU record of the cluster), and the checks and messages are the same.
@functools.cache
def _decoder(hint: Any, bindings: Bindings) -> Decoder:
    if isinstance(hint, TypeVar):
        hint = dict(bindings).get(hint, Any)
    if hint is Any:
        return _identity
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is types.UnionType or origin is typing.Union:
        return _union_decoder(hint, args, bindings)
    if origin is tuple:
        return _tuple_decoder(hint, args, bindings)
    if origin is not None and dataclasses.is_dataclass(origin):
        params = getattr(origin, "__parameters__", ())
        resolved = tuple(from_plain_hint(a, bindings) for a in args)
        inner = tuple(zip(params, resolved, strict=False))
        return _dataclass_decoder(typing.cast(type, origin), inner)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass_decoder(hint, ())
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return typing.cast(Decoder, hint)
    return functools.partial(_scalar, hint)


def _identity(data: object) -> object:
    return data


def _union_decoder(hint: Any, args: tuple[Any, ...], bindings: Bindings) -> Decoder:
    optional = type(None) in args
    members = [_decoder(a, bindings) for a in args if a is not type(None)]

    def decode(data: object) -> object:
        if data is None and optional:
            return None
        errors = []
        for member in members:
            try:
                return member(data)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        raise ValueError(f"no member of {hint!r} fits: {'; '.join(errors)}")

    return decode


def _tuple_decoder(hint: Any, args: tuple[Any, ...], bindings: Bindings) -> Decoder:
    if len(args) == 2 and args[1] is Ellipsis:
        item = _decoder(args[0], bindings)

        def decode_items(data: object) -> tuple[object, ...]:
            if not isinstance(data, list | tuple):
                raise ValueError(f"expected a list for {hint!r}, got {type(data).__name__}")
            return tuple(map(item, data))

        return decode_items
    items = tuple(_decoder(a, bindings) for a in args)

    def decode_fixed(data: object) -> tuple[object, ...]:
        if not isinstance(data, list | tuple):
            raise ValueError(f"expected a list for {hint!r}, got {type(data).__name__}")
        if len(items) != len(data):
            raise ValueError(f"expected {len(items)} items for {hint!r}, got {len(data)}")
        return tuple(d(v) for d, v in zip(items, data, strict=True))

    return decode_fixed


def _dataclass_decoder(cls: type, bindings: Bindings) -> Decoder:
    # NOTE: fields are resolved on the first call, not here: a dataclass may (indirectly) hold
    # itself, and its decoder must exist before its fields' decoders can refer to it.
    table: list[tuple[str, Decoder, bool]] = []

    def decode(data: object) -> object:
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__}: expected a mapping, got {type(data).__name__}")
        if not table:
            table.extend(_fields(cls, bindings))
        kwargs: dict[str, object] = {}
        for name, field_decoder, required in table:
            if name in data:
                try:
                    kwargs[name] = field_decoder(data[name])
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{cls.__name__}.{name}: {exc}") from exc
            elif required:
                raise ValueError(f"{cls.__name__}.{name}: missing")
        return cls(**kwargs)

    return decode


def _fields(cls: type, bindings: Bindings) -> list[tuple[str, Decoder, bool]]:
    """(name, decoder, required) of each ``__init__`` field of ``cls``."""
    hints = _field_hints(cls)
    return [
        (
            f.name,
            _decoder(hints[f.name], bindings),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
        if f.init
    ]


def _scalar(hint: Any, data: object) -> object:
    if hint is float and isinstance(data, int | float) and not isinstance(data, bool):
        return float(data)
    if hint in (int, str, bool) and type(data) is hint:
        return data
    if hint is type(None) and data is None:
        return None
    raise ValueError(f"expected {getattr(hint, '__name__', hint)}, got {data!r}")
