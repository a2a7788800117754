"""Plain-data conversion for gearbox's frozen dataclasses.

Decisions, plans and state travel on Kafka and live in faust tables, so every public value type
converts to plain JSON types (dict, list, str, int, float, bool, None) and back. The conversion is
driven by each dataclass's type hints, so a new field needs no serialisation code of its own.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Self

__all__ = ["Serialisable", "from_plain", "to_plain"]


def to_plain(value: object) -> object:
    """Convert a dataclass tree into JSON-compatible values (tuples become lists)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init
        }
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [to_plain(item) for item in value]
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot serialise non-finite float {value!r}")
        return value
    if value is None or isinstance(value, str | int | bool):
        return value
    raise TypeError(f"cannot serialise {type(value).__name__}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_plain(hint: Any, data: object) -> Any:
    """Rebuild a value of type ``hint`` from the output of :func:`to_plain`.

    Raises ``ValueError`` naming the offending field when the data does not fit the type.
    """
    origin = typing.get_origin(hint)
    if origin is types.UnionType or origin is typing.Union:
        args = typing.get_args(hint)
        if data is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) != 1:
            raise TypeError(f"unsupported union {hint!r}")
        return from_plain(non_none[0], data)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(data, list | tuple):
            raise ValueError(f"expected a list for {hint!r}, got {type(data).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_plain(args[0], item) for item in data)
        return tuple(from_plain(a, item) for a, item in zip(args, data, strict=True))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass_from_plain(hint, data)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(data)
    return _scalar_from_plain(hint, data)


def _dataclass_from_plain(cls: type, data: object) -> object:
    if not isinstance(data, Mapping):
        raise ValueError(f"{cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = _hints(cls)
    kwargs: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{cls.__name__}.{f.name}: missing")
            continue
        try:
            kwargs[f.name] = from_plain(hints[f.name], data[f.name])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{cls.__name__}.{f.name}: {exc}") from exc
    return cls(**kwargs)


def _scalar_from_plain(hint: Any, data: object) -> object:
    if hint is float and isinstance(data, int | float) and not isinstance(data, bool):
        return float(data)
    if hint in (int, str, bool) and type(data) is hint:
        return data
    raise ValueError(f"expected {getattr(hint, '__name__', hint)}, got {data!r}")


class Serialisable:
    """Adds ``to_dict``/``from_dict`` to a frozen dataclass (methods only, no state)."""

    __slots__ = ()

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-compatible dict of this value."""
        plain = to_plain(self)
        assert isinstance(plain, dict)
        return plain

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Self:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` on malformed input."""
        value = _dataclass_from_plain(cls, data)
        assert isinstance(value, cls)
        return value
