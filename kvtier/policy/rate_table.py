"""The rate forecasts of a tier's pages in arrays, ranked in one vectorised pass.

:class:`~kvtier.policy.hinted.HintedPolicy` (and ``interval``) ranks the held pages by how
far off their forecast next use is, and that distance moves with the clock, so a walk
scores every page afresh. Without hints the forecast is the *rate forecast* alone: a page
whose unforeseen references began at ``first``, were last seen at ``last`` and number
``count`` is expected at ``at = last + (last - first) / (count - 1)``; once ``at`` is past,
at ``now + (now - first) / (count - 1) + lateness x (now - at)``: the wait stretches the
mean interval, and with ``lateness`` > 0 the lateness itself counts as a sign that the
page's traffic has moved on. :class:`RateTable` keeps ``at``, ``first`` and
``count - 1`` per page in numpy arrays, so the scores of all pages cost one vectorised
pass, and :meth:`RateTable.ranked` sorts only as far as the walk reads.

The floats are the ones the scalar formula gives (the same IEEE operations in the same
order, ``(now + (now - first) / n + lateness x (now - at)) - now`` included; with
``lateness`` 0 the added term is exactly 0.0, so the floats are those of the formula
without it), and ties are broken by key as a sort of ``(score, key)`` tuples does, so a
ranking read from here is the scalar one, entry for entry.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvtier.keys import PageKey

#: Entries sorted by the first chunk of a ranking; each later chunk is four times larger.
FIRST_CHUNK = 64


class RateTable:
    """Pages with a rate forecast: slot arrays of ``at``, ``first`` and ``count - 1``."""

    def __init__(self, lateness: float = 0.0) -> None:
        """``lateness``: the weight of an overdue page's lateness in its forecast (see the
        module doc; 0 leaves the stretched mean interval alone)."""
        self.lateness = lateness
        self._slot: dict[PageKey, int] = {}
        self._keys: list[PageKey | None] = []
        self._free: list[int] = []
        self._at = np.zeros(0)
        self._first = np.zeros(0)
        self._n = np.ones(0)
        self._used = np.zeros(0, dtype=bool)

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, key: object) -> bool:
        return key in self._slot

    def _new_slot(self, key: PageKey) -> int:
        if self._free:
            slot = self._free.pop()
            self._keys[slot] = key
        else:
            slot = len(self._keys)
            self._keys.append(key)
            if slot >= self._at.size:
                grow = max(64, self._at.size)
                self._at = np.concatenate([self._at, np.zeros(grow)])
                self._first = np.concatenate([self._first, np.zeros(grow)])
                self._n = np.concatenate([self._n, np.ones(grow)])
                self._used = np.concatenate([self._used, np.zeros(grow, dtype=bool)])
        self._slot[key] = slot
        self._used[slot] = True
        return slot

    def set(self, key: PageKey, first: float, last: float, count: float) -> None:
        """Record (or update) ``key``'s unforeseen references; ``count`` must be >= 2."""
        slot = self._slot.get(key)
        if slot is None:
            slot = self._new_slot(key)
        n = count - 1.0
        self._at[slot] = last + (last - first) / n
        self._first[slot] = first
        self._n[slot] = n

    def discard(self, key: PageKey) -> None:
        """Forget ``key`` (no-op if absent)."""
        slot = self._slot.pop(key, None)
        if slot is not None:
            self._used[slot] = False
            self._keys[slot] = None
            self._free.append(slot)

    def ranked(self, now: float) -> Iterator[tuple[float, PageKey]]:
        """``(now's score, key)`` of every page, highest first and ties by key highest
        first (a reverse sort of the tuples), read lazily: the scores are computed at once,
        the order chunk by chunk. The table must not change while the ranking is read."""
        used = np.flatnonzero(self._used[: len(self._keys)])
        if used.size == 0:
            return
        at = self._at[used]
        late = self.lateness * (now - at)
        overdue = (now + (now - self._first[used]) / self._n[used] + late) - now
        scores = np.where(at >= now, at - now, overdue)
        keys = self._keys
        chunk = FIRST_CHUNK
        while used.size:
            if used.size > chunk:
                # Everything at or above the chunk-th largest score (ties included) comes
                # before everything below it.
                cut = np.partition(scores, used.size - chunk)[used.size - chunk]
                take = scores >= cut
            else:
                take = np.ones(used.size, dtype=bool)
            part = [
                (score, key)
                for score, i in zip(scores[take].tolist(), used[take].tolist(), strict=True)
                if (key := keys[i]) is not None
            ]
            part.sort(reverse=True)
            yield from part
            used, scores = used[~take], scores[~take]
            chunk *= 4
