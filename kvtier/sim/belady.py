"""Belady's MIN: the offline (clairvoyant) ceiling every replay result is shown beside.

MIN keeps the pages whose next use is soonest. On a miss it admits the page only if the
page is used again before some resident page (otherwise it bypasses the cache), and evicts
the resident page used furthest in the future. For a cache of equal-size pages this
maximises the number of hits (Belady 1966; Mattson et al. 1970 for the bypass form).

Hits are counted two ways, matching :mod:`kvtier.sim.replay`:

* ``hits``: every reference found resident when its request arrives;
* ``prefix_hits``: only the leading run of resident blocks of each request (the KV an
  engine can reuse). This is the hit rate the trace README reports.

The *ceiling* shown beside a policy's prefix hit rate is MIN's ``hits``: no policy's
prefix hits (a subset of its hits) can exceed it. On a prefix-consistent trace (a block
id stands for its whole prefix, as in Mooncake's traces and every kvtier generator) the
two counts are equal, since a page's parent is always used before it and MIN keeps
parents before children. On a trace that reuses ids out of prefix position, MIN's own
prefix hits may fall below what LRU gets, so they are no ceiling there.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey

_NEVER = 1 << 62


@dataclass(frozen=True)
class MinResult:
    """Outcome of a MIN run."""

    capacity: int
    refs: int
    hits: int
    prefix_hits: int

    @property
    def hit_rate(self) -> float:
        """Hits over references (0 for an empty trace)."""
        return self.hits / self.refs if self.refs else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Prefix hits over references (0 for an empty trace)."""
        return self.prefix_hits / self.refs if self.refs else 0.0

    @property
    def ceiling(self) -> float:
        """The most prefix hits over references any policy can get at this capacity (MIN's
        hit rate; equal to its prefix hit rate on a prefix-consistent trace)."""
        return self.hit_rate


def next_uses(flat: Sequence[PageKey]) -> list[int]:
    """For each position, the position of the next reference of the same key (or a huge
    sentinel when there is none)."""
    nxt = [_NEVER] * len(flat)
    last: dict[PageKey, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        k = flat[i]
        nxt[i] = last.get(k, _NEVER)
        last[k] = i
    return nxt


def belady_min(requests: Sequence[Sequence[PageKey]], capacity: int) -> MinResult:
    """Replay ``requests`` (each a sequence of page keys in order) through MIN.

    Every request's hits are counted when it arrives, then its blocks are referenced in
    order. Raises :class:`KVTierUsageError` for a negative capacity.
    """
    if capacity < 0:
        raise KVTierUsageError(f"MIN capacity must be >= 0 pages, got {capacity}")
    flat = [k for r in requests for k in r]
    nxt = next_uses(flat)
    cache: dict[PageKey, int] = {}  # key -> its next use
    heap: list[tuple[int, PageKey]] = []  # (-next use, key), lazily invalidated
    hits = prefix_hits = 0
    pos = 0
    for req in requests:
        in_prefix = True
        for k in req:
            if k in cache:
                hits += 1
                if in_prefix:
                    prefix_hits += 1
            else:
                in_prefix = False
        for k in req:
            n = nxt[pos]
            pos += 1
            if k in cache:
                cache[k] = n
                heapq.heappush(heap, (-n, k))
                continue
            if n == _NEVER or capacity == 0:
                continue  # never used again: bypass
            if len(cache) >= capacity:
                # Drop stale heap entries, then compare with the furthest resident page.
                while heap and cache.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                far_next, far_key = -heap[0][0], heap[0][1]
                if far_next <= n:
                    continue  # the newcomer is the furthest: bypass
                heapq.heappop(heap)
                del cache[far_key]
            cache[k] = n
            heapq.heappush(heap, (-n, k))
    return MinResult(capacity, len(flat), hits, prefix_hits)
