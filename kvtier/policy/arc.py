"""ARC: adaptive replacement cache (Megiddo and Modha, FAST'03).

Two LRU lists of resident pages, ``T1`` (seen once recently) and ``T2`` (seen at least
twice), and two ghost lists of recently evicted keys, ``B1`` and ``B2``. A ghost hit in
``B1`` says recency was undervalued and grows the target size ``p`` of ``T1``; a ghost hit
in ``B2`` shrinks it. Victims come from ``T1`` while it is larger than ``p``, else from
``T2``.

The policy interface does not pass the tier's capacity, so ``c`` (which bounds the ghosts
and ``p``) is the ``capacity`` parameter when given, else the largest number of pages
tracked so far (a tier fills up to its capacity before it evicts).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import ClassVar

from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.params import capacity_param, number_param


class ARCPolicy(EvictionPolicy):
    """Adaptive replacement between recency (``T1``) and frequency (``T2``)."""

    name: ClassVar[str] = "arc"

    def __init__(self, capacity: int | None = None, ghost_factor: float = 1.0) -> None:
        """``capacity``: the tier's pages when known (an integer >= 1), else ``None``.
        ``ghost_factor``: ghost entries kept, in capacities (>= 1). Raises
        :class:`ConfigError` naming a bad value."""
        capacity = capacity_param(self.name, capacity)
        if not number_param(self.name, "ghost_factor", ghost_factor) >= 1.0:
            raise ConfigError(f"{self.name}: ghost_factor must be >= 1, got {ghost_factor!r}")
        self.ghost_factor = float(ghost_factor)
        self._fixed_c = capacity
        self._seen_c = 0
        self.p = 0.0
        self.t1: OrderedDict[PageKey, None] = OrderedDict()
        self.t2: OrderedDict[PageKey, None] = OrderedDict()
        self.b1: OrderedDict[PageKey, None] = OrderedDict()
        self.b2: OrderedDict[PageKey, None] = OrderedDict()

    @property
    def c(self) -> int:
        """The capacity ARC adapts within."""
        return self._fixed_c or max(self._seen_c, 1)

    def on_insert(self, key: PageKey, parent: PageKey | None = None) -> None:
        if key in self.t1 or key in self.t2:
            self.on_access(key)
            return
        self._enter(key)
        self._seen_c = max(self._seen_c, len(self.t1) + len(self.t2))
        self._trim_ghosts()

    def _enter(self, key: PageKey) -> None:
        """A page not resident enters: a ghost hit adapts ``p`` (a ``B1`` hit grows the
        share of recency, a ``B2`` hit shrinks it) and goes to ``T2``; else ``T1``."""
        c = float(self.c)
        if key in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None

    def _trim_ghosts(self) -> None:
        c = self.c
        g = self.ghost_factor * c
        while self.b1 and len(self.t1) + len(self.b1) > g:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * g:
            self.b2.popitem(last=False)

    def on_access(self, key: PageKey) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def on_remove(self, key: PageKey) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
        else:
            return
        self._trim_ghosts()

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        out: list[PageKey] = []
        if n <= 0:
            return out
        it1: Iterator[PageKey] = iter(self.t1)
        it2: Iterator[PageKey] = iter(self.t2)
        n1 = len(self.t1)
        done1 = done2 = False
        while len(out) < n and not (done1 and done2):
            take_t1 = not done1 and (n1 > self.p or done2)
            if take_t1:
                k = next(it1, None)
                if k is None:
                    done1 = True
                    continue
                if evictable(k):
                    out.append(k)
                    n1 -= 1
            else:
                k = next(it2, None)
                if k is None:
                    done2 = True
                    continue
                if evictable(k):
                    out.append(k)
        return out

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2
