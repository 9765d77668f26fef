"""Byte sizes written the way operators write them: ``4MiB``, ``512k``, ``1.5GB``, ``4096``."""

from __future__ import annotations

import re

from kvtier.errors import KVTierUsageError

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes in ``text``: a plain integer or a number with a unit.

    Binary units: ``k``/``KiB``, ``M``/``MiB``, ``G``/``GiB``, ``T``/``TiB``; decimal
    units: ``kB``, ``MB``, ``GB``, ``TB`` (case-insensitive). The result must be a
    positive whole number of bytes. Raises :class:`KVTierUsageError` naming ``what`` and
    the offending text otherwise.
    """
    if isinstance(text, bool):
        raise KVTierUsageError(f"{what} must be a size such as 4MiB, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text))
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise KVTierUsageError(
                f"{what}: cannot parse {text!r} as a size (examples: 4096, 512KiB, 4MiB, 2GB)"
            )
        number = float(match.group(1)) * _UNITS[unit]
        if number != int(number):
            raise KVTierUsageError(f"{what}: {text!r} is not a whole number of bytes")
        value = int(number)
    if value <= 0:
        raise KVTierUsageError(f"{what} must be positive, got {text!r}")
    return value


def format_size(nbytes: int) -> str:
    """Short binary form: ``4MiB``, ``1.5GiB``, ``512B``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TiB"  # pragma: no cover - the loop returns at GiB
