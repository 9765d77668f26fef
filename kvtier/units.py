"""Size units: bytes from ``"4GiB"``-style strings and back.

Used by the configuration (tier capacities), the CLI (``--capacity 512MiB``) and anything
else that reads a size from a person. Raises :class:`~kvtier.errors.ConfigError` naming
the key being parsed.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

from kvtier.errors import ConfigError

#: Largest size accepted anywhere (a signed 64-bit byte count).
MAX_SIZE_BYTES = (1 << 63) - 1

_SIZE_RE = re.compile(
    r"^\s*([0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]{1,2})?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE
)
#: A plain integer in another base, as TOML writes one (``0x10``, ``0o755``, ``0b1010``).
_BASED_RE = re.compile(r"^\s*0(?:x[0-9a-f]+|o[0-7]+|b[01]+)\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_EXAMPLES = "e.g. 4096, '512MiB', '1.5GiB', '1e9'"


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from an int, a float or a size string; :class:`ConfigError` naming ``key``.

    The grammar, one for every way a size is written (TOML value, environment variable,
    command-line option): a number, written as an integer (``4096``; in a string also
    ``0x1000``, ``0o10000``, ``0b1000``, as TOML writes integers) or in decimal with an
    optional fraction and exponent (``1.5``, ``1e9``, ``2.5e3``), then an optional unit
    (strings only, spaces allowed between): ``KiB``/``MiB``/``GiB``/``TiB``/``PiB`` are
    powers of 1024, ``KB``/``MB``/``GB``/``TB``/``PB`` powers of 1000, a bare
    ``K``/``M``/``G``/``T``/``P`` is binary. The value is computed exactly; with a unit it
    is the whole bytes it holds (``"1.3GiB"``: 1395864371, ``"0.1KiB"``: 102), without one
    it must be a whole number of bytes (``4194304.7`` and ``"1e-3"`` are refused: a
    fraction of a byte is a mistake, not a size), in ``[0, 2**63 - 1]``.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{key}: expected a size in bytes or a string like '4GiB', got {value!r}")
    if isinstance(value, int):
        return _in_range(value, key, value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{key}: {value!r} is not a size ({_EXAMPLES})")
        return _whole(Fraction(value), key, value)
    if _BASED_RE.match(value):
        return _in_range(int(value.strip(), 0), key, value)
    m = _SIZE_RE.match(value)
    if not m:
        raise ConfigError(f"{key}: cannot parse {value!r} as a size ({_EXAMPLES})")
    number, unit, binary, suffix_b = m.groups()
    if binary and not unit:  # "5i", "5iB": a binary marker with no unit to mark
        raise ConfigError(
            f"{key}: {value!r} has 'i' without a unit (e.g. '5KiB', '5MiB', or 5 bytes)"
        )
    base = 1000 if (unit and not binary and suffix_b) else 1024
    exact = Fraction(number) * base ** _SIZE_POWERS[unit.lower()]
    if unit:  # a fraction of a unit ("1.3GiB"): the whole bytes it holds
        return _in_range(math.floor(exact), key, value)
    return _whole(exact, key, value)


def _whole(exact: Fraction, key: str, given: Any) -> int:
    """``exact`` as bytes; :class:`ConfigError` when it is not a whole number of them or
    out of range."""
    if exact.denominator != 1:
        raise ConfigError(
            f"{key}: {given!r} is {float(exact):.1f} bytes, not a whole number of bytes "
            "(a size must be one)"
        )
    return _in_range(exact.numerator, key, given)


def _in_range(nbytes: int, key: str, given: Any) -> int:
    if nbytes < 0:
        raise ConfigError(f"{key}: size must be in [0, 2**63 - 1] bytes, got {given!r}")
    if nbytes > MAX_SIZE_BYTES:
        raise ConfigError(f"{key}: {given!r} is too large (at most 2**63 - 1 bytes)")
    return nbytes


def format_size(nbytes: int) -> str:
    """Human form of a byte count with binary units (``4.0 GiB``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"  # pragma: no cover - loop always returns
