"""Size units: bytes from ``"4GiB"``-style strings and back.

Used by the configuration (tier capacities), the CLI (``--capacity 512MiB``) and anything
else that reads a size from a person. Raises :class:`~kvtier.errors.ConfigError` naming
the key being parsed.
"""

from __future__ import annotations

import re
from typing import Any

from kvtier.errors import ConfigError

#: Largest size accepted anywhere (a signed 64-bit byte count).
MAX_SIZE_BYTES = (1 << 63) - 1

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from an int or a size string (``"4GiB"``, ``"512 MiB"``, ``"1.5GB"``, ``"4096"``).

    ``KiB``/``MiB``/``GiB`` are powers of 1024, ``KB``/``MB``/``GB`` powers of 1000; a bare
    ``K``/``M``/``G`` means the binary unit. Raises :class:`ConfigError` naming ``key``.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size in bytes or a string like '4GiB', got {value!r}")
    if isinstance(value, int):
        if not 0 <= value <= MAX_SIZE_BYTES:
            raise ConfigError(f"{key}: size must be in [0, 2**63 - 1] bytes, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and 0 <= value <= MAX_SIZE_BYTES:
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            number, unit, binary, _b = m.groups()
            if binary and not unit:  # "5i", "5iB": a binary marker with no unit to mark
                raise ConfigError(
                    f"{key}: {value!r} has 'i' without a unit (e.g. '5KiB', '5MiB', or 5 bytes)"
                )
            base = 1000 if (unit and not binary and _b) else 1024
            result = float(number) * base ** _SIZE_POWERS[unit.lower()]
            if result > MAX_SIZE_BYTES:
                raise ConfigError(f"{key}: {value!r} is too large (at most 2**63 - 1 bytes)")
            if result.is_integer() or unit:
                return int(result)
    raise ConfigError(f"{key}: cannot parse {value!r} as a size (e.g. 4096, '512MiB', '4GiB')")


def format_size(nbytes: int) -> str:
    """Human form of a byte count with binary units (``4.0 GiB``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"  # pragma: no cover - loop always returns
