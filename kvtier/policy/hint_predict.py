"""Predicted uses of pages, added per hint: the per-key work of a ``next_turn`` or
``open`` hint in :class:`~kvtier.policy.hinted.HintedPolicy`, done for all of its keys in
one call (the same steps, in the same order, as one call per key)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, MutableMapping
from operator import itemgetter
from typing import Any

from kvtier.keys import PageKey

#: A predicted use: (at, overdue after, tolerance).
Use = tuple[float, float, float]

#: A page keeps at most this many pending predicted uses (the soonest).
MAX_PENDING = 8

#: A use's overdue time (``max(map(overdue_of, uses))``: the latest, no generator).
overdue_of = itemgetter(1)


def add_predictions(
    keys: Iterable[PageKey],
    use: Use,
    predicted: dict[PageKey, tuple[Use, ...]],
    overdue: list[tuple[float, PageKey]],
    cleared: tuple[MutableMapping[PageKey, Any], ...],
) -> list[tuple[float, PageKey]]:
    """Add ``use`` to the pending uses (tuples) of each of ``keys`` (sorted, the soonest
    ``MAX_PENDING`` kept); push (the time after which all of a page's uses are overdue,
    page) on the heap ``overdue``, rebuilt from ``predicted`` once it holds over four
    entries per page (plus 64); drop each key from the maps in ``cleared`` (a prediction
    revives a closed or expiring page). Returns the heap (a new list once rebuilt)."""
    for key in keys:
        pending = predicted.get(key)
        if pending is None:
            predicted[key] = (use,)
            last_due = use[1]
        else:  # sorted as list.append then list.sort (stable) would, the soonest kept
            merged = sorted((*pending, use))
            del merged[MAX_PENDING:]
            predicted[key] = tuple(merged)
            last_due = max(map(overdue_of, merged))
        heapq.heappush(overdue, (last_due, key))
        if len(overdue) > 4 * len(predicted) + 64:
            overdue = [(max(map(overdue_of, pend)), k) for k, pend in predicted.items() if pend]
            heapq.heapify(overdue)
        for mapping in cleared:
            if mapping:
                mapping.pop(key, None)
    return overdue
