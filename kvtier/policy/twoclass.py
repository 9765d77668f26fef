"""``two-class``: recency with a protection bonus for reused pages, one knob from LRU to
LRU-2.

Every page is *cold* (referenced once within its retained history) or *hot* (referenced at
least twice; the history of evicted pages is kept for ``history`` capacities, as LRU-K's
retained information period, so a page reused after its eviction comes back hot). Time is
a clock that ticks on every reference. The eviction score of a page is

* cold: the time of its last reference;
* hot, ``order="last"``: the time of its last reference plus ``bonus x capacity`` ticks;
* hot, ``order="kth"``: the time of its second most recent reference (LRU-2's backward
  2-distance) plus the same bonus;
* hot, ``order="freq"``: the time of its last reference plus the bonus times its use
  count minus one, capped at 3 (2, 3, 4+ uses: S3-FIFO's 2-bit counters, as a head start);

and the lowest score goes first. An infinite bonus puts every cold page before every hot
one (with ``freq``, hot pages by use count, then by time). ``bonus = 0`` with
``order="last"`` is LRU exactly; ``bonus = inf`` with ``order="kth"`` is LRU-2 exactly
(cold pages first, least recently used first, then hot pages by their second most recent
reference); values in between give reused pages a head start measured in capacities of
traffic, which is what ARC's and S3-FIFO's split between a probation and a protected part
approximate. The bookkeeping
(:class:`TwoClassBook`) does not depend on ``bonus`` or ``order``, so one book can serve
any of them: the ``adaptive`` policy switches between them for free.

All hooks are O(1) amortised; ``victims`` merges the heads of the cold list and of the
hot lists (one per use count), or of a heap for the ``kth`` order (stale entries skipped).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from typing import ClassVar

from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.params import capacity_param, nonnegative_param

ORDERS: tuple[str, ...] = ("last", "kth", "freq")

#: Hot pages are kept in one list per use count: 2, 3, and 4 or more.
LEVELS = 3


class TwoClassBook:
    """Cold pages, hot pages by use count and last reference, hot pages by second most
    recent reference, and the retained reference history of evicted pages."""

    def __init__(
        self, history: float = 8.0, capacity: int | None = None, orders: tuple[str, ...] = ORDERS
    ) -> None:
        """``orders``: the orders :meth:`ordered` will be asked for (all by default); a book
        for ``kth`` alone keeps no per-count lists, one without ``kth`` no heap."""
        self.history = history
        #: Which structures the orders asked for need: the lists by use count, the heap.
        self._lists = any(o != "kth" for o in orders)
        self._heap = "kth" in orders
        self.orders = tuple(orders)
        self._fixed_c = capacity
        self._seen_c = 0
        self.clock = 0
        #: (uses, second most recent, most recent reference) per known page; 0 = none.
        self.refs: dict[PageKey, tuple[int, int, int]] = {}
        self.resident: set[PageKey] = set()
        self.cold: OrderedDict[PageKey, int] = OrderedDict()
        self.hot: list[OrderedDict[PageKey, int]] = [OrderedDict() for _ in range(LEVELS)]
        self._level: dict[PageKey, int] = {}
        self.kth: list[tuple[int, PageKey]] = []
        self.retained: OrderedDict[PageKey, None] = OrderedDict()

    @property
    def c(self) -> int:
        """The capacity in pages (given, or the most pages held at once)."""
        return self._fixed_c or max(self._seen_c, 1)

    def _touch(self, key: PageKey) -> None:
        self.clock = now = self.clock + 1
        refs = self.refs
        prev = refs.get(key)
        if prev is None:
            # unknown, so not resident before (a resident page keeps its references)
            refs[key] = (1, 0, now)
            self.cold[key] = now
            return
        uses = prev[0] + 1
        second = prev[2]
        refs[key] = (uses if uses < 255 else 255, second, now)
        self.cold.pop(key, None)
        level = uses - 2 if uses < LEVELS + 1 else LEVELS - 1
        if self._lists:
            old = self._level.get(key)
            if old is not None and old != level:
                del self.hot[old][key]
            lst = self.hot[level]
            lst[key] = now
            lst.move_to_end(key)
        self._level[key] = level
        if self._heap:
            kth = self.kth
            heapq.heappush(kth, (second, key))
            if len(kth) > 4 * len(self.resident) + 64:
                self.kth = [(refs[k][1], k) for k in self._level]
                heapq.heapify(self.kth)

    def insert(self, key: PageKey) -> None:
        """``key`` entered (it is not resident)."""
        if self.retained:
            self.retained.pop(key, None)
        resident = self.resident
        resident.add(key)
        if len(resident) > self._seen_c:
            self._seen_c = len(resident)
        self._touch(key)

    def access(self, key: PageKey) -> None:
        """A resident ``key`` was referenced."""
        self._touch(key)

    def remove(self, key: PageKey) -> None:
        """``key`` left; its history is retained for a while."""
        self.resident.discard(key)
        self.cold.pop(key, None)
        level = self._level.pop(key, None)
        if level is not None and self._lists:
            del self.hot[level][key]
        retained = self.retained
        retained[key] = None
        limit = self.history * (self._fixed_c or max(self._seen_c, 1))
        if len(retained) > limit:
            refs = self.refs
            while len(retained) > limit:
                old, _ = retained.popitem(last=False)
                del refs[old]

    def _kth_order(self) -> Generator[tuple[PageKey, int], None, None]:
        """Hot pages by second most recent reference. Entries are popped as they are
        read and pushed back when the iteration ends or is dropped (stale ones are
        dropped for good), so the heap is only ordered as far as someone reads."""
        heap = self.kth
        held: list[tuple[int, PageKey]] = []
        try:
            while heap:
                item = heapq.heappop(heap)
                t, key = item
                if key not in self._level or self.refs[key][1] != t:
                    continue  # stale
                held.append(item)
                yield key, t
        finally:
            for item in held:
                heapq.heappush(heap, item)

    def ordered(
        self,
        bonus: float,
        order: str,
        probation: float = 0.0,
        evictable: Callable[[PageKey], bool] | None = None,
    ) -> Generator[PageKey, None, None]:
        """The resident pages (those ``evictable`` accepts, when given), lowest score
        first (see the module docstring); while the cold pages not yet yielded are at
        most ``probation`` of the capacity, hot pages come first. Lazy: a caller that
        reads ``m`` pages pays for about ``m`` (plus stale heap entries). The book must
        not change while the iterator is in use."""
        if order not in self.orders:
            raise ValueError(f"two-class: this book does not keep the {order!r} order")
        cold_floor = probation * self.c
        finite = math.isfinite(bonus)
        extra = bonus * self.c if finite else 0.0
        # Streams of (key, time), each in ascending time, and how a time becomes a score.
        streams: list[Iterator[tuple[PageKey, int]]] = [iter(self.cold.items())]
        ranks: list[tuple[int, float]] = [(0, 0.0)]  # (class rank, time offset)
        kth = None
        if order == "kth":
            kth = self._kth_order()
            streams.append(kth)
            ranks.append((0, extra) if finite else (1, 0.0))
        else:
            for level, lst in enumerate(self.hot):
                streams.append(iter(lst.items()))
                if order == "freq":
                    ranks.append((0, extra * (level + 1)) if finite else (level + 1, 0.0))
                else:
                    ranks.append((0, extra) if finite else (1, 0.0))

        def head(i: int) -> tuple[int, float, PageKey] | None:
            for key, t in streams[i]:
                if evictable is None or evictable(key):
                    rank, offset = ranks[i]
                    return rank, t + offset, key
            return None

        try:
            heads = [head(i) for i in range(len(streams))]
            cold_left = len(self.cold)
            while True:
                best = None
                protect = cold_left <= cold_floor
                for i, h in enumerate(heads):
                    if h is None or (protect and i == 0):
                        continue
                    if best is None or h[:2] < heads[best][:2]:  # type: ignore[index]
                        best = i
                if best is None:
                    if heads[0] is None:
                        return
                    best = 0  # only cold pages are left
                chosen = heads[best]
                assert chosen is not None
                yield chosen[2]
                if best == 0:
                    cold_left -= 1
                heads[best] = head(best)
        finally:
            if kth is not None:
                kth.close()

    def victims(
        self,
        n: int,
        evictable: Callable[[PageKey], bool],
        bonus: float,
        order: str,
        probation: float = 0.0,
    ) -> list[PageKey]:
        """Up to ``n`` victims: the first ``n`` of :meth:`ordered` over the pages
        ``evictable`` accepts."""
        if n <= 0:
            return []
        it = self.ordered(bonus, order, probation, evictable)
        try:
            return list(itertools.islice(it, n))
        finally:
            it.close()


class TwoClassPolicy(EvictionPolicy):
    """Recency with a protection bonus for reused pages (see the module docstring)."""

    name: ClassVar[str] = "two-class"

    def __init__(
        self,
        bonus: float = math.inf,
        order: str = "kth",
        history: float = 8.0,
        capacity: int | None = None,
        probation: float = 0.0,
    ) -> None:
        """``bonus``: head start of hot pages, in capacities of references (``inf``:
        cold pages always go first). ``order``: ``last``, ``kth`` or ``freq``. ``history``:
        capacities of evicted pages whose history is kept. Raises :class:`ConfigError`
        for a bad value."""
        check_two_class(bonus, order, history, capacity)
        if (
            isinstance(probation, bool)
            or not isinstance(probation, int | float)
            or not (0.0 <= probation < 1.0)
        ):
            raise ConfigError(f"two-class: probation must lie in [0, 1), got {probation!r}")
        self.probation = float(probation)
        self.bonus = float(bonus)
        self.order = order
        self.book = TwoClassBook(float(history), capacity, (order,))

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        if key in self.book.resident:
            self.book.access(key)
        else:
            self.book.insert(key)

    def on_access(self, key: PageKey) -> None:
        if key in self.book.resident:
            self.book.access(key)

    def on_remove(self, key: PageKey) -> None:
        if key in self.book.resident:
            self.book.remove(key)

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        return self.book.victims(n, evictable, self.bonus, self.order, self.probation)

    def ordered_keys(
        self, evictable: Callable[[PageKey], bool] | None = None
    ) -> Iterator[PageKey] | None:
        """The book's order (see :mod:`kvtier.policy.base`), lazily; ``None`` with a
        probation share, whose hot-first switch counts the cold pages actually taken."""
        if self.probation:
            return None
        return self.book.ordered(self.bonus, self.order)

    def __len__(self) -> int:
        return len(self.book.resident)

    def __contains__(self, key: object) -> bool:
        return key in self.book.resident


def check_two_class(
    bonus: object, order: object, history: object, capacity: object, owner: str = "two-class"
) -> None:
    """Raise :class:`ConfigError` naming a bad ``two-class`` parameter and ``owner``, the
    policy that was given it (``adaptive`` checks its own parameters here too)."""
    if isinstance(bonus, bool) or not isinstance(bonus, int | float) or not bonus >= 0:
        raise ConfigError(f"{owner}: bonus must be a number >= 0 (or inf), got {bonus!r}")
    if order not in ORDERS:
        raise ConfigError(f"{owner}: order must be one of {', '.join(ORDERS)}, got {order!r}")
    nonnegative_param(owner, "history", history)
    capacity_param(owner, capacity)
