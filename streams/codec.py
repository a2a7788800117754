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


def from_plain(hint: Any, data: object, bindings: tuple[tuple[Any, Any], ...] = ()) -> Any:
    """Rebuild a value of type ``hint`` from plain JSON data (``ValueError`` when it does not
    fit). ``bindings`` maps type variables of an enclosing generic dataclass to their types."""
    if isinstance(hint, TypeVar):
        hint = dict(bindings).get(hint, Any)
    if hint is Any:
        return data
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is types.UnionType or origin is typing.Union:
        if data is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return from_plain(arg, data, bindings)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        raise ValueError(f"no member of {hint!r} fits: {'; '.join(errors)}")
    if origin is tuple:
        if not isinstance(data, list | tuple):
            raise ValueError(f"expected a list for {hint!r}, got {type(data).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_plain(args[0], item, bindings) for item in data)
        if len(args) != len(data):
            raise ValueError(f"expected {len(args)} items for {hint!r}, got {len(data)}")
        return tuple(from_plain(a, item, bindings) for a, item in zip(args, data, strict=True))
    if origin is not None and dataclasses.is_dataclass(origin):
        params = getattr(origin, "__parameters__", ())
        resolved = tuple(from_plain_hint(a, bindings) for a in args)
        return _dataclass(
            typing.cast(type, origin), data, tuple(zip(params, resolved, strict=False))
        )
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass(hint, data, ())
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(data)
    return _scalar(hint, data)


def from_plain_hint(hint: Any, bindings: tuple[tuple[Any, Any], ...]) -> Any:
    """``hint`` with bound type variables substituted."""
    return dict(bindings).get(hint, hint) if isinstance(hint, TypeVar) else hint


def _dataclass(cls: type, data: object, bindings: tuple[tuple[Any, Any], ...]) -> object:
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = _field_hints(cls)
    kwargs: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name not in data:
            if (
                f.init
                and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING
            ):
                raise ValueError(f"{cls.__name__}.{f.name}: missing")
            continue
        try:
            kwargs[f.name] = from_plain(hints[f.name], data[f.name], bindings)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{cls.__name__}.{f.name}: {exc}") from exc
    return cls(**kwargs)


def _scalar(hint: Any, data: object) -> object:
    if hint is float and isinstance(data, int | float) and not isinstance(data, bool):
        return float(data)
    if hint in (int, str, bool) and type(data) is hint:
        return data
    if hint is type(None) and data is None:
        return None
    raise ValueError(f"expected {getattr(hint, '__name__', hint)}, got {data!r}")
