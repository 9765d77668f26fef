"""Checks of eviction-policy parameters, shared by the policies' constructors.

Parameters come from Python calls and from a tier's ``eviction_params`` table in TOML,
where a quoted number (``capacity = "5"``) arrives as a string: each check raises
:class:`~kvtier.errors.ConfigError` naming the policy, the parameter and the value,
instead of letting a comparison fail with a ``TypeError`` that names neither.
"""

from __future__ import annotations

import math

from kvtier.errors import ConfigError


def number_param(policy: str, name: str, value: object) -> float:
    """``value`` as a float; :class:`ConfigError` (``"arc: ghost_factor must be a number,
    got '2'"``) unless it is an ``int`` or ``float`` (not a bool). Range checks are the
    caller's: NaN passes here."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{policy}: {name} must be a number, got {value!r}")
    return float(value)


def capacity_param(policy: str, value: object) -> int | None:
    """A policy's ``capacity``: ``None`` (unknown: the policy uses the most pages held at
    once) or an ``int`` >= 1 (pages); :class:`ConfigError` naming ``policy`` otherwise
    (a float such as 1.5, NaN or infinity, a string, a bool)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{policy}: capacity must be an integer >= 1 page (or unset), got {value!r}"
        )
    return value


def nonnegative_param(policy: str, name: str, value: object, *, finite: bool = False) -> float:
    """``value`` as a float >= 0 (and finite when ``finite``); :class:`ConfigError`
    (``"hinted: history must be a number >= 0, got nan"``) for anything else: a string, a
    bool, NaN, a negative number, infinity when ``finite``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not value >= 0
        or (finite and not math.isfinite(value))
    ):
        kind = "a finite number" if finite else "a number"
        raise ConfigError(f"{policy}: {name} must be {kind} >= 0, got {value!r}")
    return float(value)


def share_param(policy: str, name: str, value: object) -> float:
    """``value`` as a float in [0, 1]; :class:`ConfigError` naming the policy, the
    parameter and the value for anything else (a string, a bool, NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{policy}: {name} must lie in [0, 1], got {value!r}")
    return float(value)
