"""Textbook reference caches: an independent check of kvtier's policy objects.

These are straight transcriptions of the published algorithms, written without kvtier's
:class:`~kvtier.policy.base.EvictionPolicy` interface, its replay or its prefix tree, so
that a test can compare kvtier's policies against them on hand-made sequences and the
suite can show what a textbook simulator gets on the same traffic:

* ``lru``: least recently used.
* ``lru-k`` (O'Neil, O'Neil and Weikum, SIGMOD'93): evict the block whose K-th most recent
  reference is oldest; blocks with fewer than K references have an infinite backward
  K-distance and go first, least recently used first. History is kept for evicted blocks
  (the paper's retained information period, here unbounded), so a block that comes back
  after an eviction resumes its history.
* ``arc`` (Megiddo and Modha, FAST'03): the paper's four cases with ``REPLACE``, ghost
  lists ``B1``/``B2`` bounded by ``c`` and ``2c``.
* ``s3-fifo`` (Yang et al., SOSP'23): small FIFO (10 %), main FIFO, ghost FIFO as large as
  the main queue, 2-bit counters; a small-queue block seen again since insertion moves to
  main, a main block with a non-zero counter is reinserted with the counter decremented.

Request semantics are those of :mod:`kvtier.sim.replay` (and of a live cache): a
request's prefix hits are counted when it arrives (the leading run of resident blocks),
then its resident blocks are referenced in order, then its missed blocks are admitted in
order. What the engine pins is never evicted while the request runs: its cached prefix
(it loaded it) and the blocks it stores (one batch: none is the victim of another);
a resident block past the prefix is referenced but not pinned, as in the live cache.
:func:`reference_prefix_hits` returns the prefix hits, which equal the replay's when the
policy is textbook-correct and every request fits in the cache.

Speed is secondary (heaps, no clever structures): fine for tests and single runs.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Protocol

from kvtier.errors import KVTierUsageError

REFERENCE_ALGORITHMS: tuple[str, ...] = ("lru", "lru-k", "arc", "s3-fifo")


class _Cache(Protocol):
    def __contains__(self, key: object) -> bool: ...

    def hit(self, key: Hashable) -> None: ...

    def admit(self, key: Hashable, pinned: set[Hashable]) -> None: ...


class _LRU:
    def __init__(self, c: int) -> None:
        self.c = c
        self.d: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self.d

    def hit(self, key: Hashable) -> None:
        self.d.move_to_end(key)

    def admit(self, key: Hashable, pinned: set[Hashable]) -> None:
        if len(self.d) >= self.c:
            victim = next((k for k in self.d if k not in pinned), None)
            if victim is None:
                return  # everything is pinned: the block is used, not kept
            del self.d[victim]
        self.d[key] = None


class _LRUK:
    """LRU-K with unbounded retained history."""

    def __init__(self, c: int, k: int) -> None:
        self.c = c
        self.k = k
        self.t = itertools.count(1)
        self.hist: dict[Hashable, list[int]] = {}  # most recent first, at most k entries
        self.resident: set[Hashable] = set()
        self.heap: list[tuple[tuple[int, int], Hashable]] = []

    def __contains__(self, key: object) -> bool:
        return key in self.resident

    def _ref(self, key: Hashable) -> None:
        h = self.hist.setdefault(key, [])
        h.insert(0, next(self.t))
        del h[self.k :]

    def hit(self, key: Hashable) -> None:
        self._ref(key)
        heapq.heappush(self.heap, (self._rank(key), key))

    def _rank(self, key: Hashable) -> tuple[int, int]:
        h = self.hist[key]
        kth = h[self.k - 1] if len(h) >= self.k else 0  # 0: infinite backward distance
        return (kth, h[0])  # ties (all < K refs): least recently used first

    def admit(self, key: Hashable, pinned: set[Hashable]) -> None:
        self._ref(key)
        if len(self.resident) >= self.c:
            # A heap of (rank, key) with stale entries skipped: the resident block of
            # lowest rank that is not pinned.
            held: list[tuple[tuple[int, int], Hashable]] = []
            victim = None
            while self.heap:
                rank, cand = heapq.heappop(self.heap)
                if cand not in self.resident or rank != self._rank(cand):
                    continue
                if cand in pinned:
                    held.append((rank, cand))
                    continue
                victim = cand
                break
            for item in held:
                heapq.heappush(self.heap, item)
            if victim is None:
                return
            self.resident.discard(victim)  # its history stays
        self.resident.add(key)
        heapq.heappush(self.heap, (self._rank(key), key))


class _ARC:
    def __init__(self, c: int) -> None:
        self.c = c
        self.p = 0.0
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def hit(self, key: Hashable) -> None:  # case I
        if key in self.t1:
            del self.t1[key]
        else:
            del self.t2[key]
        self.t2[key] = None

    @staticmethod
    def _lru(lst: OrderedDict[Hashable, None], pinned: set[Hashable]) -> Hashable | None:
        return next((k for k in lst if k not in pinned), None)

    def _replace(self, in_b2: bool, pinned: set[Hashable]) -> None:
        n1 = len(self.t1)
        v1 = self._lru(self.t1, pinned)
        v2 = self._lru(self.t2, pinned)
        if v1 is not None and (n1 > self.p or (in_b2 and n1 == self.p) or v2 is None):
            del self.t1[v1]
            self.b1[v1] = None
        elif v2 is not None:
            del self.t2[v2]
            self.b2[v2] = None

    def admit(self, key: Hashable, pinned: set[Hashable]) -> None:
        c = self.c
        if key in self.b1:  # case II
            self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            self._replace(False, pinned)
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:  # case III
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            self._replace(True, pinned)
            del self.b2[key]
            self.t2[key] = None
        else:  # case IV
            l1 = len(self.t1) + len(self.b1)
            total = l1 + len(self.t2) + len(self.b2)
            if l1 >= c:
                if len(self.t1) < c and self.b1:
                    self.b1.popitem(last=False)
                    self._replace(False, pinned)
                else:
                    v = self._lru(self.t1, pinned)
                    if v is not None:
                        del self.t1[v]
                    else:
                        self._replace(False, pinned)
            elif total >= c:
                if total >= 2 * c and self.b2:
                    self.b2.popitem(last=False)
                self._replace(False, pinned)
            self.t1[key] = None
        while len(self.t1) + len(self.t2) > c:  # all pinned: keep the newcomer's request
            self._replace(False, set())


class _S3FIFO:
    def __init__(self, c: int, small_ratio: float = 0.1) -> None:
        self.c = c
        self.s_cap = max(1, round(small_ratio * c))
        self.m_cap = max(1, c - self.s_cap)
        self.s: OrderedDict[Hashable, None] = OrderedDict()  # head = newest (end)
        self.m: OrderedDict[Hashable, None] = OrderedDict()
        self.g: OrderedDict[Hashable, None] = OrderedDict()
        self.freq: dict[Hashable, int] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.freq

    def hit(self, key: Hashable) -> None:
        self.freq[key] = min(self.freq[key] + 1, 3)

    def _evict_m(self, pinned: set[Hashable]) -> bool:
        for _ in range(4 * len(self.m) + 1):
            if not self.m:
                return False
            t = next(iter(self.m))
            del self.m[t]
            if t in pinned:
                self.m[t] = None
                continue
            if self.freq[t] > 0:
                self.freq[t] -= 1
                self.m[t] = None
            else:
                del self.freq[t]
                return True
        return False

    def _evict_s(self, pinned: set[Hashable]) -> bool:
        for _ in range(len(self.s)):
            t = next(iter(self.s))
            del self.s[t]
            if t in pinned:
                self.s[t] = None
                continue
            if self.freq[t] > 0:
                self.freq[t] = 0
                self.m[t] = None
                if len(self.m) > self.m_cap:
                    self._evict_m(pinned)
            else:
                del self.freq[t]
                self.g[t] = None
                while len(self.g) > self.m_cap:
                    self.g.popitem(last=False)
                return True
        return False

    def admit(self, key: Hashable, pinned: set[Hashable]) -> None:
        while len(self.freq) >= self.c:
            if len(self.s) >= self.s_cap or not self.m:
                done = self._evict_s(pinned) or self._evict_m(pinned)
            else:
                done = self._evict_m(pinned) or self._evict_s(pinned)
            if not done:
                return
        self.freq[key] = 0
        if key in self.g:
            del self.g[key]
            self.m[key] = None
        else:
            self.s[key] = None


def make_reference(algorithm: str, capacity: int, k: int = 2) -> _Cache:
    """A fresh textbook cache; :class:`KVTierUsageError` for an unknown name or a bad
    capacity."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise KVTierUsageError(f"reference cache capacity must be an int >= 1, got {capacity!r}")
    if algorithm == "lru":
        return _LRU(capacity)
    if algorithm == "lru-k":
        return _LRUK(capacity, k)
    if algorithm == "arc":
        return _ARC(capacity)
    if algorithm == "s3-fifo":
        return _S3FIFO(capacity)
    raise KVTierUsageError(
        f"unknown reference algorithm {algorithm!r}; known: {', '.join(REFERENCE_ALGORITHMS)}"
    )


def reference_prefix_hits(
    requests: Sequence[Sequence[Hashable]], capacity: int, algorithm: str, k: int = 2
) -> list[int]:
    """Per request, the prefix hits of the textbook ``algorithm`` with ``capacity`` blocks
    (request semantics as in the module docstring)."""
    cache = make_reference(algorithm, capacity, k)
    out: list[int] = []
    for req in requests:
        n = 0
        for b in req:
            if b not in cache:
                break
            n += 1
        out.append(n)
        seen: set[Hashable] = set()
        missed: list[Hashable] = []
        for b in req:
            if b in seen:
                continue
            seen.add(b)
            if b in cache:
                cache.hit(b)
            else:
                missed.append(b)
        pinned = set(req[:n]) | set(missed)  # the loaded prefix and the stored batch
        for b in missed:
            cache.admit(b, pinned)
    return out
