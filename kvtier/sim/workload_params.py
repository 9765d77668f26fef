"""Checks of a generated workload's parameters, by parameter name, before it is built.

Every generator of :data:`kvtier.sim.workloads.WORKLOADS` takes keyword parameters whose
names mean the same thing across generators: a count of things (``prefixes``,
``tenants``, ``docs``...) is an integer >= 1, a rate or a time scale (``rate``,
``think_s``...) a finite number > 0, a share (``carry``, ``loyal``...) a number in
[0, 1], a Zipf exponent (``alpha``) a finite number >= 0. :func:`check_params` applies
those rules, so a bad value is a :class:`~kvtier.errors.KVTierUsageError` that names the
workload, the parameter and the value, not an ``IndexError`` from inside a generator or,
for a negative rate, a trace with negative timestamps. A parameter the generator does
not take is refused with the list of those it does.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping

from kvtier.errors import KVTierUsageError

_COUNT_NAMES = (
    "block_tokens docs doc_blocks prefixes tools topics k count phases every tenants turn "
    "systems per_system examples documents chats"
)
#: Integers with a lower bound: how many of something a generator makes or draws.
INTEGERS: dict[str, int] = {**dict.fromkeys(_COUNT_NAMES.split(), 1), "swaps": 0}
#: Finite numbers > 0: arrival rates and time scales.
POSITIVE = frozenset({"rate", "burst_rate", "calm_rate", "think_s", "shape"})
#: Numbers in [0, 1].
SHARES = frozenset({"carry", "loyal", "doc_share", "scan_share"})
#: Finite numbers >= 0.
EXPONENTS = frozenset({"alpha"})
#: No range rule here: ``n`` (checked by :func:`~kvtier.sim.workloads.workload`),
#: ``seed`` (any integer; only its type is checked) and ``arrivals`` (a list of arrivals
#: or None, passed on as given).
OTHERS = frozenset({"n", "seed", "arrivals"})
#: Every parameter name with a rule here.
KNOWN = frozenset(INTEGERS) | POSITIVE | SHARES | EXPONENTS | OTHERS


def _rule(name: str, value: object) -> str | None:
    """What ``value`` must be for the parameter ``name``, or None when it is fine."""
    low = INTEGERS.get(name)
    if low is not None or name == "seed":
        if not isinstance(value, int) or isinstance(value, bool):
            return "an integer" if low is None else f"an integer >= {low}"
        return None if low is None or value >= low else f"an integer >= {low}"
    if name in OTHERS:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "a number"
    x = float(value)
    if name in POSITIVE and not (math.isfinite(x) and x > 0):
        return "a finite number > 0"
    if name in SHARES and not 0.0 <= x <= 1.0:
        return "a number in [0, 1]"
    if name in EXPONENTS and not (math.isfinite(x) and x >= 0):
        return "a finite number >= 0"
    return None


def check_params(workload: str, gen: Callable[..., object], params: Mapping[str, object]) -> None:
    """Raise :class:`KVTierUsageError` for a parameter ``gen`` does not take (listing
    those it does) or a value its name's rule refuses (module doc)."""
    takes = inspect.signature(gen).parameters
    for name, value in params.items():
        if name not in takes:
            raise KVTierUsageError(
                f"workload {workload!r} has no parameter {name!r}; "
                f"its parameters: {', '.join(takes)}"
            )
        need = _rule(name, value)
        if need is not None:
            raise KVTierUsageError(f"workload {workload!r}: {name} must be {need}, got {value!r}")
