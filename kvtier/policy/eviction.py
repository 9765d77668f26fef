"""Classic eviction policies: LRU and LRU-K (the source article's section 3.1).

Both keep their state in ordered dicts; every hook is O(1) except LRU-K's victim scan,
which walks pages from the coldest in the order of their K-th most recent access.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import ClassVar

from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy, first_evictable


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

    def ordered_keys(self) -> Iterator[PageKey]:
        """Every tracked key, best victim first (``victims`` takes the first evictable
        ones of this order): the optional hook described in :mod:`kvtier.policy.base`."""
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class LRUKPolicy(EvictionPolicy):
    """LRU-K (O'Neil et al.): evict the page whose K-th most recent access is oldest.

    Pages with fewer than K accesses have an infinitely old K-th access and go first, in
    LRU order among themselves: a page touched once (a scan) cannot push out a page that
    was reused. This is the article's hot/cold split with K = 2 by default.
    """

    name: ClassVar[str] = "lru-k"

    def __init__(self, k: int = 2) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"lru-k: k must be an integer >= 1, got {k!r}")
        self.k = k
        self._clock = 0
        self._history: dict[PageKey, deque[int]] = {}
        # Pages with < k accesses, oldest last access first.
        self._cold: OrderedDict[PageKey, None] = OrderedDict()

    def _touch(self, key: PageKey) -> None:
        self._clock += 1
        hist = self._history.setdefault(key, deque(maxlen=self.k))
        hist.append(self._clock)
        if len(hist) < self.k:
            self._cold[key] = None
            self._cold.move_to_end(key)
        else:
            self._cold.pop(key, None)

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        self._touch(key)

    def on_access(self, key: PageKey) -> None:
        if key in self._history:
            self._touch(key)

    def on_remove(self, key: PageKey) -> None:
        self._history.pop(key, None)
        self._cold.pop(key, None)

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        return first_evictable(self._order(), n, evictable)

    def ordered_keys(self) -> Iterator[PageKey]:
        """Every tracked key, best victim first: pages with fewer than K accesses in LRU
        order, then the others by their K-th most recent access (the hot part is sorted
        only if the iteration gets there). See :mod:`kvtier.policy.base`."""
        return self._order()

    def _order(self) -> Iterator[PageKey]:
        yield from self._cold
        hot = ((hist[0], key) for key, hist in self._history.items() if len(hist) >= self.k)
        for _, key in heapq.nsmallest(len(self._history), hot):
            yield key

    def __len__(self) -> int:
        return len(self._history)

    def __contains__(self, key: object) -> bool:
        return key in self._history


#: Eviction policies by config name. Other modules add theirs with :func:`register_policy`.
EVICTION_POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    LRUKPolicy.name: LRUKPolicy,
}


def register_policy(name: str, factory: Callable[..., EvictionPolicy]) -> None:
    """Make an eviction policy selectable by ``name`` in config."""
    EVICTION_POLICIES[name] = factory


def make_policy(name: str, **params: object) -> EvictionPolicy:
    """Build the eviction policy ``name`` with ``params``; :class:`ConfigError` if unknown."""
    try:
        factory = EVICTION_POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(EVICTION_POLICIES))
        raise ConfigError(f"unknown eviction policy {name!r}; known: {known}") from None
    try:
        return factory(**params)
    except TypeError as exc:
        raise ConfigError(f"eviction policy {name!r}: bad parameters {params}: {exc}") from None
