"""Classic eviction policies: LRU and LRU-K (the source article's section 3.1).

Both keep their state in ordered dicts; every hook is O(1) except LRU-K's victim scan,
which walks pages from the coldest in the order of their K-th most recent access.
"""

from __future__ import annotations

import heapq
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar

from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy, first_evictable
from kvtier.policy.params import capacity_param


class LRUPolicy(EvictionPolicy):
    """Least recently used: the page untouched for longest goes first."""

    name: ClassVar[str] = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[PageKey, None] = OrderedDict()

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: PageKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: PageKey) -> None:
        self._order.pop(key, None)

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        return first_evictable(iter(self._order), n, evictable)

    def ordered_keys(self, evictable: Callable[[PageKey], bool] | None = None) -> Iterator[PageKey]:
        """Every tracked key, best victim first (``victims`` takes the first evictable
        ones of this order, which does not depend on ``evictable``): the optional hook
        described in :mod:`kvtier.policy.base`."""
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class LRUKPolicy(EvictionPolicy):
    """LRU-K (O'Neil, O'Neil and Weikum, SIGMOD'93): evict the page whose K-th most recent
    reference is oldest.

    Pages with fewer than K known references have an infinitely old K-th reference and go
    first, in LRU order among themselves: a page touched once (a scan) cannot push out a
    page that was reused. This is the article's hot/cold split with K = 2 by default.

    As in the paper, the reference history of a page is *retained after it is evicted*
    (the "retained information period"): a page that comes back finds its earlier
    references and, at its second reference, competes as a hot page. Without this, a page
    reused only after it was evicted would count one reference forever and LRU-K would
    lose to LRU exactly where LRU-2 should win. The retained histories of evicted pages
    are bounded to ``history`` times the capacity (oldest evictions forgotten first);
    ``capacity`` is the tier's size in pages when known, else the most pages held at once.

    Victims: cold pages by last reference, then hot pages by K-th reference (a heap with
    stale entries skipped), so ``victims`` costs O(n log pages) and not a full sort.
    """

    name: ClassVar[str] = "lru-k"

    def __init__(self, k: int = 2, history: float = 8.0, capacity: int | None = None) -> None:
        """Raises :class:`ConfigError` for ``k`` < 1, ``history`` < 0 or a bad
        ``capacity``."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"lru-k: k must be an integer >= 1, got {k!r}")
        if isinstance(history, bool) or not isinstance(history, int | float) or not history >= 0:
            raise ConfigError(f"lru-k: history must be a number >= 0 (capacities), got {history!r}")
        capacity = capacity_param("lru-k", capacity)
        self.k = k
        self.history = float(history)
        self._fixed_c = capacity
        self._seen_c = 0
        self._clock = 0
        #: Reference times per known page (resident or evicted), most recent last.
        #: (tuples, which the garbage collector does not track, unlike deques).
        self._hist: dict[PageKey, tuple[int, ...]] = {}
        self._resident: set[PageKey] = set()
        # Resident pages with < k references, oldest last reference first.
        self._cold: OrderedDict[PageKey, None] = OrderedDict()
        # Resident pages with k references: (k-th most recent reference, key), lazily.
        self._hot: list[tuple[int, PageKey]] = []
        # Evicted pages whose history is retained, oldest eviction first.
        self._retained: OrderedDict[PageKey, None] = OrderedDict()

    @property
    def c(self) -> int:
        """The capacity in pages (given, or the most pages held at once)."""
        return self._fixed_c or max(self._seen_c, 1)

    def _touch(self, key: PageKey) -> None:
        self._clock = clock = self._clock + 1
        k = self.k
        hist = self._hist.get(key)
        if hist is None:
            hist = (clock,)
        elif len(hist) < k:
            hist = (*hist, clock)
        else:  # the oldest reference leaves, as from a deque of maxlen k
            hist = (*hist[1:], clock)
        self._hist[key] = hist
        if len(hist) < k:
            cold = self._cold
            cold[key] = None
            cold.move_to_end(key)
        else:
            if self._cold:
                self._cold.pop(key, None)
            heapq.heappush(self._hot, (hist[0], key))
            if len(self._hot) > 4 * len(self._resident) + 64:
                self._compact()

    def _compact(self) -> None:
        """Drop stale heap entries (a page's older K-th references, evicted pages)."""
        k = self.k
        self._hot = [(h[0], key) for key in self._resident if len(h := self._hist[key]) >= k]
        heapq.heapify(self._hot)

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        if key in self._resident:
            self.on_access(key)
            return
        if self._retained:
            self._retained.pop(key, None)
        resident = self._resident
        resident.add(key)
        self._touch(key)
        if len(resident) > self._seen_c:
            self._seen_c = len(resident)

    def on_access(self, key: PageKey) -> None:
        if key in self._resident:
            self._touch(key)

    def on_remove(self, key: PageKey) -> None:
        if key not in self._resident:
            return
        self._resident.discard(key)
        self._cold.pop(key, None)
        retained = self._retained
        retained[key] = None
        limit = self.history * (self._fixed_c or max(self._seen_c, 1))  # self.c
        while len(retained) > limit:
            old, _ = retained.popitem(last=False)
            del self._hist[old]

    def _valid(self, kth: int, key: PageKey) -> bool:
        if key not in self._resident:
            return False
        hist = self._hist[key]
        return len(hist) >= self.k and hist[0] == kth

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        out = first_evictable(iter(self._cold), n, evictable)
        if len(out) >= n:
            return out
        heap = self._hot
        popped: list[tuple[int, PageKey]] = []
        while heap and len(out) < n:
            item = heapq.heappop(heap)
            if not self._valid(*item):
                continue  # stale: dropped for good
            popped.append(item)
            if evictable(item[1]):
                out.append(item[1])
        for item in popped:  # victims() removes nothing: on_remove does
            heapq.heappush(heap, item)
        return out

    def ordered_keys(self, evictable: Callable[[PageKey], bool] | None = None) -> Iterator[PageKey]:
        """Every resident key, best victim first (``victims`` takes the first evictable
        ones of this order, which does not depend on ``evictable``): pages with fewer
        than K references in LRU order, then the others by their K-th most recent
        reference (the hot part is ordered only if the iteration gets there). See
        :mod:`kvtier.policy.base`."""
        yield from self._cold
        # The heap read in order without copying it: a frontier of positions whose
        # parents were read (O(m log m) for the first m entries, not O(pages)). One valid
        # entry per hot page: its current K-th reference; stale ones are skipped.
        heap = self._hot
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            item, i = heapq.heappop(frontier)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
            if self._valid(*item):
                yield item[1]

    def order_of(self, keys: Iterable[PageKey]) -> list[PageKey]:
        """The resident ones of ``keys`` in :meth:`ordered_keys`' order, sorted directly
        (cold pages by last reference, then hot ones by K-th most recent reference; clock
        ticks are unique, so there are no ties): for a few keys, cheaper than walking the
        whole order to find them."""
        cold: list[tuple[int, PageKey]] = []
        hot: list[tuple[int, PageKey]] = []
        k = self.k
        for key in keys:
            if key in self._resident:
                hist = self._hist[key]
                if len(hist) < k:
                    cold.append((hist[-1], key))
                else:
                    hot.append((hist[0], key))
        cold.sort()
        hot.sort()
        return [key for _, key in cold] + [key for _, key in hot]

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: object) -> bool:
        return key in self._resident


#: Eviction policies by config name. Other modules add theirs with :func:`register_policy`.
EVICTION_POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    LRUKPolicy.name: LRUKPolicy,
}


def register_policy(name: str, factory: Callable[..., EvictionPolicy]) -> None:
    """Make an eviction policy selectable by ``name`` in config."""
    EVICTION_POLICIES[name] = factory


def make_policy(name: str, **params: object) -> EvictionPolicy:
    """Build the eviction policy ``name`` with ``params``; :class:`ConfigError` if unknown,
    or for a parameter it does not take (naming those it takes, from its signature)."""
    try:
        factory = EVICTION_POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(EVICTION_POLICIES))
        raise ConfigError(f"unknown eviction policy {name!r}; known: {known}") from None
    try:
        return factory(**params)
    except TypeError as exc:
        try:
            taken = list(inspect.signature(factory).parameters.values())
        except (TypeError, ValueError):  # no signature to read: the error as it is
            taken = [inspect.Parameter("params", inspect.Parameter.VAR_KEYWORD)]
        names = [p.name for p in taken if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        bad = [k for k in params if k not in names]
        if not bad or any(p.kind is p.VAR_KEYWORD for p in taken):
            raise ConfigError(f"eviction policy {name!r}: bad parameters {params}: {exc}") from None
        raise ConfigError(
            f"unknown parameter {bad[0]!r} for eviction policy {name!r}; it takes: "
            f"{', '.join(names) or 'no parameters'}"
        ) from None
