"""``hinted``: evict by what the engine said (see :mod:`kvtier.policy.hints`), and by a
fallback policy where it said nothing.

For every page the policy keeps what the hints imply:

* a *predicted next use* (``next_turn``: the hint's time plus its gap; ``open``: the
  typical gap seen in ``next_turn`` hints so far), consumed when the page is referenced
  and dropped as *overdue* once the session is late by more than its own gap;
* *dead* pages (``close``, or a ``ttl`` that ran out): nothing more will come for them;
* *pinned* pages (``pin``, until ``unpin``) and *weights* (``priority``).

Victims, in order: dead pages (oldest death first); pages without a live prediction, in
the fallback policy's order (low-weight pages before high-weight ones); pages with a
prediction, the furthest predicted use first (Belady's rule on what the engine knows),
the distance divided by the page's weight; pinned pages last. A page referenced again
after a ``close`` or past its ``ttl`` simply comes back to life: a wrong hint costs the
hits it lost, never correctness. Hints given for pages the tier does not hold are kept
for ``history`` capacities of pages, so a hint that arrives before its pages does count.

Time comes from :meth:`on_time` (the replay passes the trace's clock, the live cache
``time.monotonic()``); without it every prediction is relative to the last hint.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import ClassVar

from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.hints import Hint


def _flip(fn: Callable[[PageKey, bool], bool], flag: bool, key: PageKey) -> bool:
    return fn(key, flag)


def _fallback(name: str) -> EvictionPolicy:
    from kvtier.policy.eviction import make_policy

    if name == "hinted":
        raise ConfigError("hinted: the fallback cannot be 'hinted' itself")
    return make_policy(name)


class HintedPolicy(EvictionPolicy):
    """Engine hints first, ``fallback`` for the pages hints say nothing about."""

    name: ClassVar[str] = "hinted"

    def __init__(
        self, fallback: str = "lru-k", history: float = 4.0, pin_share: float = 0.5
    ) -> None:
        """``fallback``: a registered policy name. ``history``: how many capacities of
        hinted pages not (or no longer) in the tier keep their hint. ``pin_share``: pins
        are honoured while pinned pages fill at most this share of the tier (an engine
        pinning more than fits gets plain eviction for them). Raises
        :class:`ConfigError` for a bad value."""
        if isinstance(history, bool) or not isinstance(history, int | float) or history < 0:
            raise ConfigError(f"hinted: history must be a number >= 0, got {history!r}")
        if (
            isinstance(pin_share, bool)
            or not isinstance(pin_share, int | float)
            or not (0.0 <= pin_share <= 1.0)
        ):
            raise ConfigError(f"hinted: pin_share must lie in [0, 1], got {pin_share!r}")
        self.pin_share = float(pin_share)
        self.fallback = _fallback(fallback)
        self.history = float(history)
        self.now = 0.0
        self._seen_c = 0
        self._resident: set[PageKey] = set()
        #: page -> pending predicted uses (time, overdue after, tolerance), soonest first;
        #: a page shared by several sessions has one per session (at most 8).
        self._predicted: dict[PageKey, list[tuple[float, float, float]]] = {}
        self._heap: list[tuple[float, int, PageKey]] = []  # (-predicted use, seq, page)
        self._seq = itertools.count()
        self._dead: OrderedDict[PageKey, None] = OrderedDict()
        self._pinned: set[PageKey] = set()
        self._weight: dict[PageKey, float] = {}
        self._expiry: dict[PageKey, float] = {}
        # Hinted pages the tier does not hold, oldest first (bounded by ``history``).
        self._absent: OrderedDict[PageKey, None] = OrderedDict()
        self._typical_gap = 60.0
        self.hints_seen = 0

    @property
    def c(self) -> int:
        """The most pages held at once (the capacity once the tier has filled)."""
        return max(self._seen_c, 1)

    # -- hints and time ---------------------------------------------------------------

    def on_time(self, now_s: float) -> None:
        if now_s > self.now:
            self.now = now_s

    def _predict(self, key: PageKey, at: float, overdue: float, tolerance: float) -> None:
        pending = self._predicted.setdefault(key, [])
        pending.append((at, overdue, tolerance))
        pending.sort()
        del pending[8:]
        self._dead.pop(key, None)
        self._expiry.pop(key, None)
        live = self._live_prediction(key)
        if live is not None:
            heapq.heappush(self._heap, (-live, next(self._seq), key))
        if len(self._heap) > 4 * len(self._predicted) + 64:
            self._heap = [
                (-at, next(self._seq), k)
                for k in self._predicted
                if (at := self._live_prediction(k)) is not None  # type: ignore[assignment]
            ]
            heapq.heapify(self._heap)

    def _note_absent(self, key: PageKey) -> None:
        if key in self._resident:
            return
        self._absent[key] = None
        self._absent.move_to_end(key)
        limit = self.history * self.c
        while len(self._absent) > limit:
            old, _ = self._absent.popitem(last=False)
            self._forget(old)

    def _forget(self, key: PageKey) -> None:
        self._predicted.pop(key, None)
        self._dead.pop(key, None)
        self._pinned.discard(key)
        self._weight.pop(key, None)
        self._expiry.pop(key, None)

    def on_hint(self, hint: Hint, now_s: float) -> None:
        self.on_time(now_s)
        now = self.now
        self.hints_seen += 1
        kind = hint.kind
        if kind == "next_turn":
            assert hint.value is not None
            gap = hint.value
            self._typical_gap += 0.05 * (gap - self._typical_gap)
            for k in hint.keys:
                self._predict(k, now + gap, now + 2 * gap + 1.0, 0.1 * gap + 1.0)
        elif kind == "open":
            gap = self._typical_gap
            for k in hint.keys:
                self._predict(k, now + gap, now + 2 * gap + 1.0, 0.1 * gap + 1.0)
        elif kind == "close":
            for k in hint.keys:
                self._predicted.pop(k, None)
                self._dead[k] = None
                self._dead.move_to_end(k)
        elif kind == "ttl":
            assert hint.value is not None
            for k in hint.keys:
                self._expiry[k] = now + hint.value
        elif kind == "priority":
            assert hint.value is not None
            for k in hint.keys:
                if hint.value == 1.0:
                    self._weight.pop(k, None)
                else:
                    self._weight[k] = hint.value
        elif kind == "pin":
            self._pinned.update(hint.keys)
        elif kind == "unpin":
            self._pinned.difference_update(hint.keys)
        for k in hint.keys:
            self._note_absent(k)

    # -- the EvictionPolicy hooks -------------------------------------------------------

    def _referenced(self, key: PageKey) -> None:
        pending = self._predicted.get(key)
        if pending is not None:  # the predicted uses due by now happened
            now = self.now
            left = [p for p in pending if p[0] > now + p[2] and p[1] >= now]
            if left:
                self._predicted[key] = left
                heapq.heappush(self._heap, (-left[0][0], next(self._seq), key))
            else:
                del self._predicted[key]
        self._dead.pop(key, None)  # a closed page used again: the hint was wrong
        exp = self._expiry.get(key)
        if exp is not None and exp <= self.now:
            del self._expiry[key]

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        if key in self._resident:
            self.on_access(key)
            return
        self._resident.add(key)
        self._absent.pop(key, None)
        self._seen_c = max(self._seen_c, len(self._resident))
        self._referenced(key)
        self.fallback.on_insert(key, parent)

    def on_access(self, key: PageKey) -> None:
        if key in self._resident:
            self._referenced(key)
            self.fallback.on_access(key)

    def on_remove(self, key: PageKey) -> None:
        if key not in self._resident:
            return
        self._resident.discard(key)
        self.fallback.on_remove(key)
        if (
            key in self._predicted
            or key in self._dead
            or key in self._pinned
            or key in self._weight
            or key in self._expiry
        ):
            self._note_absent(key)

    def _live_prediction(self, key: PageKey) -> float | None:
        """The soonest pending predicted use that is not overdue, if any."""
        pending = self._predicted.get(key)
        if not pending:
            return None
        for at, overdue, _ in pending:
            if overdue >= self.now:
                return at
        return None

    def _is_dead(self, key: PageKey) -> bool:
        if key in self._dead:
            return True
        exp = self._expiry.get(key)
        return exp is not None and exp <= self.now

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        out: list[PageKey] = []
        chosen: set[PageKey] = set()

        def take(key: PageKey) -> None:
            out.append(key)
            chosen.add(key)

        def usable(key: PageKey) -> bool:
            return key in self._resident and key not in chosen and evictable(key)

        pinned: set[PageKey] | frozenset[PageKey] = self._pinned
        if sum(1 for key in pinned if key in self._resident) > self.pin_share * self.c:
            pinned = frozenset()  # more pinned than the tier can afford: plain pages
        for key in self._dead:  # 1. dead pages
            if len(out) >= n:
                return out
            if key not in pinned and usable(key):
                take(key)
        if self._expiry:
            for key, exp in list(self._expiry.items()):
                if len(out) >= n:
                    return out
                if exp <= self.now and key not in pinned and usable(key):
                    take(key)
        weight = self._weight

        # 2. no live prediction: the fallback's order, light pages before heavy ones
        def plain(key: PageKey, heavy: bool) -> bool:
            return (
                usable(key)
                and key not in pinned
                and self._live_prediction(key) is None
                and (weight.get(key, 1.0) > 1.0) == heavy
            )

        for heavy in (False, True):
            if len(out) < n:
                got = self.fallback.victims(n - len(out), functools.partial(_flip, plain, heavy))
                for key in got:
                    take(key)
        if len(out) >= n:
            return out
        # 3. live predictions, furthest (weighted) first
        if weight:
            cands: list[tuple[float, PageKey]] = []
            for key in self._predicted:
                at = self._live_prediction(key)  # type: ignore[assignment]
                if at is not None and key not in pinned and usable(key):
                    cands.append(((at - self.now) / weight.get(key, 1.0), key))
            for _, key in heapq.nlargest(n - len(out), cands):
                take(key)
        else:
            held: list[tuple[float, int, PageKey]] = []
            heap = self._heap
            while heap and len(out) < n:
                item = heapq.heappop(heap)
                if self._live_prediction(item[2]) != -item[0]:
                    continue  # replaced, consumed or overdue: gone for good
                held.append(item)
                if item[2] not in pinned and usable(item[2]):
                    take(item[2])
            for item in held:
                heapq.heappush(heap, item)
        # 4. pinned pages, only when nothing else is left
        if len(out) < n:
            rest = self.fallback.victims(n - len(out), usable)
            for key in rest:
                take(key)
        return out

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: object) -> bool:
        return key in self._resident
