"""Hints from the engine: what an inference server knows that a cache cannot guess.

A :class:`Hint` names pages and says something about their future:

* ``open``: a session holding these pages is active (its pages will be wanted again);
* ``close``: the session is over (nothing more will come from it);
* ``next_turn``: the session's next turn is expected in ``value`` seconds (an agent
  waiting for a tool call, a chat whose user typically answers within a minute);
* ``ttl``: the pages are worth keeping for ``value`` seconds, no longer;
* ``priority``: a weight (``value`` > 0, 1 = normal): a premium tenant, an SLO class;
* ``pin`` / ``unpin``: a system prompt that must stay cached (until unpinned).

``open``, ``next_turn`` and ``ttl`` are *holds*: a session holds its pages until a
``close`` (or a later hint for the same pages) releases them. Hints are advice: a policy
may ignore them, and a hint-aware policy must stay correct (and, in kvtier, never worse
than without hints) when they are wrong. :func:`parse_hint` turns the dict form used by
the trace format and the ``KVCache.hint`` call into a :class:`Hint`, raising
:class:`~kvtier.errors.KVTierUsageError` naming a bad field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvtier.errors import KVTierUsageError
from kvtier.keys import KEY_BYTES, PageKey

#: Hint kinds and whether each needs a ``value``.
HINT_KINDS: dict[str, bool] = {
    "open": False,
    "close": False,
    "next_turn": True,
    "ttl": True,
    "priority": True,
    "pin": False,
    "unpin": False,
}


@dataclass(frozen=True, slots=True)
class Hint:
    """One hint about ``keys``.

    Attributes:
        kind: one of :data:`HINT_KINDS`.
        keys: the pages the hint is about (a session's context, a system prompt).
        value: seconds for ``next_turn`` and ``ttl``, a weight for ``priority``, else
            ``None``.
    """

    kind: str
    keys: tuple[PageKey, ...]
    value: float | None = None

    def __post_init__(self) -> None:
        """Check every field, naming a bad one. A real number ``value`` (numpy's too)
        becomes a ``float`` and any sequence of keys a tuple."""
        if not isinstance(self.kind, str) or self.kind not in HINT_KINDS:
            raise KVTierUsageError(
                f"unknown hint kind {self.kind!r}; known: {', '.join(HINT_KINDS)}"
            )
        if isinstance(self.keys, bytes | bytearray | str) or not isinstance(self.keys, Sequence):
            raise KVTierUsageError(
                f"hint keys must be a sequence of page keys, got {self.keys!r:.40}"
            )
        if not isinstance(self.keys, tuple):
            object.__setattr__(self, "keys", tuple(self.keys))
        needs = HINT_KINDS[self.kind]
        if needs:
            v = _real_value(self.kind, self.value)
            if v is None or not math.isfinite(v):
                raise KVTierUsageError(
                    f"hint {self.kind!r} needs a finite number value, got {self.value!r}"
                )
            if v < 0 or (self.kind == "priority" and v <= 0):
                raise KVTierUsageError(
                    f"hint {self.kind!r}: value must be "
                    f"{'> 0' if self.kind == 'priority' else '>= 0'}, got {self.value!r}"
                )
            object.__setattr__(self, "value", v)
        elif self.value is not None:
            raise KVTierUsageError(f"hint {self.kind!r} takes no value, got {self.value!r:.60}")
        for i, k in enumerate(self.keys):
            if not isinstance(k, bytes) or len(k) != KEY_BYTES:
                raise KVTierUsageError(
                    f"hint keys[{i}] must be a {KEY_BYTES}-byte page key, got {k!r:.40}"
                )


def _real_value(kind: str, value: object) -> float | None:
    """``value`` as a float when it is a real number (not a bool), else ``None``. Raises
    :class:`KVTierUsageError` for one beyond the float range."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, Real):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer (or a fraction) beyond the float range
        if isinstance(value, Integral):
            digits = len(str(abs(int(value))))
            raise KVTierUsageError(
                f"hint {kind!r}: value is an integer too large for a float ({digits} digits)"
            ) from None
        shown = repr(value)
        shown = shown if len(shown) <= 40 else f"{shown[:36]}..."
        raise KVTierUsageError(f"hint {kind!r}: value {shown} is beyond the float range") from None


class NextUse:
    """When a ``next_turn`` or ``open`` hint says its pages are used next. ``next_turn``
    gives the gap (and moves the typical gap towards it); ``open`` takes the typical gap
    of the ``next_turn`` hints so far (60 s before the first)."""

    def __init__(self) -> None:
        self.typical_gap = 60.0

    def window(self, hint: Hint, now: float) -> tuple[float, float, float] | None:
        """``(at, overdue, tolerance)`` for a ``next_turn`` or ``open`` hint given at
        ``now``: the use is expected at ``at``, counts as on time from ``at - tolerance``
        and is overdue after ``overdue``; ``None`` for the other kinds."""
        if hint.kind == "next_turn":
            assert hint.value is not None
            gap = hint.value
            self.typical_gap += 0.05 * (gap - self.typical_gap)
        elif hint.kind == "open":
            gap = self.typical_gap
        else:
            return None
        return now + gap, now + 2 * gap + 1.0, 0.1 * gap + 1.0


def sub_hint(hint: Hint, keys: tuple[PageKey, ...]) -> Hint:
    """``hint`` for ``keys``, some of its own keys (a sample of them): equal to
    ``Hint(hint.kind, keys, hint.value)``, without checking again what ``hint`` passed."""
    if keys is hint.keys:
        return hint
    out = object.__new__(Hint)
    object.__setattr__(out, "kind", hint.kind)
    object.__setattr__(out, "keys", keys)
    object.__setattr__(out, "value", hint.value)
    return out


def make_hint(kind: str, keys: Sequence[PageKey], value: float | None = None) -> Hint:
    """A :class:`Hint` with ``keys`` as a tuple (validated)."""
    if isinstance(keys, bytes | bytearray | str):
        raise KVTierUsageError("hint keys must be a sequence of page keys, not a single key")
    return Hint(kind, tuple(keys), value)


def parse_hint(row: Mapping[str, Any], key_of: Callable[[int], PageKey], where: str) -> Hint:
    """A hint from its trace form ``{"hint": kind, "hash_ids": [...], "value": x}``;
    :class:`KVTierUsageError` naming ``where`` and the field otherwise."""
    kind = row.get("hint")
    if not isinstance(kind, str):
        raise KVTierUsageError(f"{where}: field 'hint' must be a string")
    if "hash_ids" not in row:  # a hint names its pages, as a request line does
        raise KVTierUsageError(f"{where}: missing field 'hash_ids' (the pages the hint names)")
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids
    ):
        raise KVTierUsageError(f"{where}: field 'hash_ids' must be a list of ints >= 0")
    value = row.get("value")
    try:
        return make_hint(kind, [key_of(b) for b in ids], value)
    except KVTierUsageError as exc:
        raise KVTierUsageError(f"{where}: {exc}") from None


@runtime_checkable
class HintAware(Protocol):
    """What a policy implements to use hints. ``now_s`` is the caller's clock (the live
    cache: ``time.monotonic()``; the replay: the trace's time)."""

    def on_hint(self, hint: Hint, now_s: float) -> None:
        """Take ``hint`` into account."""

    def on_time(self, now_s: float) -> None:
        """The clock moved on (called before each request in replay and on each cache
        call that references pages live): hints with times compare against it."""


def hint_target(policy: object) -> HintAware | None:
    """The hint-aware policy inside ``policy`` (wrappers such as the leaf-first one
    expose theirs as ``inner``), or ``None``."""
    seen = 0
    p: object | None = policy
    while p is not None and seen < 8:
        if isinstance(p, HintAware):
            return p
        p = getattr(p, "inner", None)
        seen += 1
    return None
