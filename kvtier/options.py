"""A backend's own options, declared once and checked at construction (for plugin authors).

A backend's options reach its constructor from Python, from a TOML file, or from
``KVTIER_TIERS__<NAME>__OPTIONS__<OPTION>`` environment variables (parsed as TOML literals,
so ``=12`` is an integer and ``='"12"'`` a string). Declare them as a frozen dataclass
whose fields carry a type and a default (or none: a required option), with bounds or
allowed values through :func:`option`; :func:`parse_options` converts what arrived and
raises :class:`~kvtier.errors.ConfigError` naming the backend, the option and what is
wrong::

    @dataclass(frozen=True)
    class MyOptions:
        path: Path                                     # required
        fsync: bool = True
        batch_pages: int = option(8, minimum=1, maximum=1024)
        mode: str = option("fast", choices=("fast", "safe"))
        timeout_s: float | None = None                 # None: no deadline

    class MyStore(StoreBackend):
        def __init__(self, *, page_bytes, capacity_pages, io_threads=None, **options):
            self.options = parse_options("mystore", options, MyOptions)
            super().__init__(page_bytes=page_bytes, capacity_pages=capacity_pages,
                             io_threads=io_threads)

Field types: ``bool``, ``int``, ``float``, ``str``, :class:`pathlib.Path`, and any of them
``| None``. Conversions are the ones a person typing a config means, and no others: a
``bool`` from ``true/false/yes/no/on/off/1/0`` strings; an ``int`` from an integer, an
integral float or a string of digits (never from a bool); a ``float`` from any finite
number or numeric string; a ``Path`` from a string; ``None`` from ``None`` or the string
``"none"``. Bounds refuse ``nan`` and infinities.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from kvtier.errors import ConfigError

T = TypeVar("T")

_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})
_SCALARS: tuple[type, ...] = (bool, int, float, str, Path)


def option(
    default: Any = dataclasses.MISSING,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    choices: Collection[Any] | None = None,
) -> Any:
    """A dataclass field with a ``default`` (none: the option is required), inclusive
    numeric bounds and/or the values allowed."""
    meta = {"minimum": minimum, "maximum": maximum, "choices": choices}
    return dataclasses.field(default=default, metadata={"kvtier_option": meta})


def parse_options(backend: str, raw: Mapping[str, Any], spec: type[T]) -> T:
    """``raw`` converted to ``spec`` (a dataclass, see the module docstring).

    Raises:
        ConfigError: an option ``spec`` does not declare (the known ones are listed), a
            required option missing, or a value of the wrong type, out of bounds or not
            among the allowed ones; the message names ``backend`` and the option.
        TypeError: ``spec`` is not a dataclass or declares a type this module does not
            convert (a bug in the backend, not in the configuration).
    """
    if not (isinstance(spec, type) and dataclasses.is_dataclass(spec)):
        raise TypeError(f"parse_options needs a dataclass type, got {spec!r}")
    fields = {f.name: f for f in dataclasses.fields(spec) if f.init}
    hints = typing.get_type_hints(spec)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(
            f"{backend}: unknown option(s) {', '.join(map(str, unknown))}; "
            f"known: {', '.join(fields) or 'none'}"
        )
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{backend}: option {name!r} is required")
            continue
        values[name] = _convert(backend, name, raw[name], hints[name], f.metadata)
    return spec(**values)


def _convert(backend: str, name: str, value: Any, hint: Any, metadata: Mapping[str, Any]) -> Any:
    kind, optional = _kind(hint, name)
    what = f"{backend} option {name!r}"
    if value is None or (optional and isinstance(value, str) and value.lower() == "none"):
        if optional:
            return None
        raise ConfigError(f"{what} must be {_noun(kind)}, got None")
    out = _scalar(what, kind, value)
    meta = metadata.get("kvtier_option", {})
    choices = meta.get("choices")
    if choices is not None and out not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{what} must be one of {allowed}, got {value!r}")
    lo, hi = meta.get("minimum"), meta.get("maximum")
    if (lo is not None or hi is not None) and isinstance(out, int | float):
        low = -math.inf if lo is None else lo
        high = math.inf if hi is None else hi
        if not low <= out <= high:
            raise ConfigError(f"{what} must be in [{_bound(low)}, {_bound(high)}], got {value!r}")
    return out


def _bound(x: float) -> str:
    """A bound as written, exactly (``1048576``, not ``1.04858e+06``; ``0.5``, ``inf``)."""
    if isinstance(x, int):
        return str(x)
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


def _kind(hint: Any, name: str) -> tuple[type, bool]:
    """The scalar type of a field and whether ``None`` is allowed."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and rest[0] in _SCALARS:
            return rest[0], True
    elif hint in _SCALARS:
        return hint, False
    raise TypeError(f"option {name!r}: parse_options cannot convert type {hint!r}")


def _noun(kind: type) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            Path: "a path"}[kind]  # fmt: skip


def _scalar(what: str, kind: type, value: Any) -> Any:
    wrong = ConfigError(f"{what} must be {_noun(kind)}, got {value!r}")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise wrong
    if kind in (str, Path):
        if isinstance(value, str) or (kind is Path and isinstance(value, Path)):
            return kind(value)
        raise wrong
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise wrong
    if kind is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            if math.isfinite(value) and value == int(value):
                return int(value)
            raise wrong
        try:
            return int(value.strip())
        except ValueError:
            raise wrong from None
    try:
        num = float(value)
    except (ValueError, OverflowError):
        raise wrong from None
    if not math.isfinite(num):
        raise ConfigError(f"{what} must be a finite number, got {value!r}")
    return num


def mask_url_password(url: str) -> str:
    """``url`` with its password, if any, shown as ``***`` (``redis://user:***@host``);
    a text that does not parse as a URL is returned as it is."""
    try:
        password = urlsplit(url).password
    except ValueError:
        return url
    return url.replace(f":{password}@", ":***@", 1) if password else url
