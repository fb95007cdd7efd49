"""Frozen records as JSON: one schema per record, so a file format is defined once.

A stage's options and results are frozen dataclasses. :func:`to_json` writes one as plain
JSON values and :func:`from_json` reads it back through the same field list and type
annotations, refusing unknown and missing keys and values of the wrong type (a typo in a
hand-edited file fails loudly). :func:`record_key` hashes a record whole, so a cache key can
never leave one of its options out.

Supported field types: bool, int, float, str, None unions (``X | None``), ``tuple[X, ...]``,
``dict[str, Any]`` (kept as it is), ``dict[str, X]`` (each value read as X) and nested records.
A field made with :func:`optional_key` is left out of the JSON while it is None, so a key that
a format writes only when it has a value keeps that layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from typing import Any, TypeVar

from npuq.errors import NpuqError

R = TypeVar("R")
_OMIT_NONE = "npuq.records.omit_none"


def optional_key(default: Any = None) -> Any:
    """A field whose key :func:`to_json` leaves out while its value is None (a missing key
    reads back as ``default``)."""
    return dataclasses.field(default=default, metadata={_OMIT_NONE: True})


def to_json(record: Any) -> dict[str, Any]:
    """The record's fields as JSON values (tuples as lists, nested records as objects)."""
    if not dataclasses.is_dataclass(record) or isinstance(record, type):
        raise TypeError(f"expected a dataclass record, got {type(record).__name__}")
    return {f.name: _plain(getattr(record, f.name)) for f in dataclasses.fields(record)
            if not (f.metadata.get(_OMIT_NONE) and getattr(record, f.name) is None)}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_json(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def from_json(cls: type[R], data: Any, what: str) -> R:
    """``cls`` rebuilt from :func:`to_json`'s output; :class:`NpuqError` naming ``what`` and the
    field on any key or type that does not fit. The record's own checks (``__post_init__``)
    run as on construction."""
    if not isinstance(data, dict):
        raise NpuqError(f"{what}: expected an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise NpuqError(f"{what}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise NpuqError(f"{what}: missing key {name!r}")
            continue
        values[name] = _value(hints[name], data[name], f"{what}: {name}")
    try:
        return cls(**values)
    except (NpuqError, TypeError, ValueError) as exc:  # the record's own checks, named by where it was read
        raise NpuqError(f"{what}: {exc}") from None


def _value(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for option in inner:
            try:
                return _value(option, value, where)
            except NpuqError as exc:
                errors.append(str(exc))
        raise NpuqError(errors[0] if len(errors) == 1 else f"{where}: {value!r:.60} fits none of its types")
    if hint is Any:
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise NpuqError(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise NpuqError(f"{where}: expected an object, got {type(value).__name__}")
        if len(args) == 2 and args[1] is not Any:
            return {k: _value(args[1], v, f"{where}[{k!r:.40}]") for k, v in value.items()}
        return value
    if dataclasses.is_dataclass(hint):
        return from_json(hint, value, where)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer beyond any float
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"{where}: field type {hint!r} is not supported by npuq.records")
    raise NpuqError(f"{where}: expected {hint.__name__}, got {value!r:.60}")


def record_key(*parts: Any) -> str:
    """Stable 16-hex-digit key of records (hashed whole, with their type names) and JSON values."""
    plain = [{"record": type(p).__name__, **to_json(p)} if dataclasses.is_dataclass(p) else _plain(p) for p in parts]
    text = json.dumps(plain, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
