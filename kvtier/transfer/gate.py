"""The priority gate: at most ``slots`` batches in flight on a link, served by priority.

Three queues share each link: demand fetches (:attr:`Priority.FETCH`), prefetches
(:attr:`Priority.PREFETCH`), then evictions and write-downs (:attr:`Priority.EVICT`).
A free slot goes to the waiter with the lowest priority value, first come first served
within a priority; a waiter cancelled after it was granted a slot passes it on.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from enum import IntEnum

from kvtier.errors import KVTierUsageError
from kvtier.metrics import CacheMetrics


class Priority(IntEnum):
    """Queue priorities: lower runs first."""

    FETCH = 0
    PREFETCH = 1
    EVICT = 2


QUEUE_NAMES = {Priority.FETCH: "fetch", Priority.PREFETCH: "prefetch", Priority.EVICT: "evict"}


class PriorityGate:
    """At most ``slots`` holders at once; waiters are served lowest priority value first
    (FIFO within a priority). Cancel-safe: a waiter cancelled after being granted a slot
    gives it back."""

    def __init__(self, slots: int, metrics: CacheMetrics | None = None) -> None:
        if slots < 1:
            raise KVTierUsageError(f"a link needs at least one slot in flight, got {slots}")
        self.slots = slots
        self.active = 0
        self._heap: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._metrics = metrics
        self._depth = dict.fromkeys(Priority, 0)

    def depth(self, priority: Priority | None = None) -> int:
        """Waiters queued (at ``priority``, or all)."""
        if priority is None:
            return sum(self._depth.values())
        return self._depth[priority]

    def _gauge(self, priority: Priority, delta: int) -> None:
        self._depth[priority] += delta
        if self._metrics is not None:
            self._metrics.queue_depth.add(delta, QUEUE_NAMES[priority])

    async def acquire(self, priority: Priority) -> None:
        if self.active < self.slots and not self._heap:
            self.active += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (int(priority), next(self._seq), fut))
        self._gauge(priority, +1)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted just as we were cancelled: pass it on
            else:
                fut.cancel()
                self._gauge(priority, -1)
            raise

    def release(self) -> None:
        while self._heap:
            prio, _, fut = heapq.heappop(self._heap)
            if fut.cancelled():
                continue
            self._gauge(Priority(prio), -1)
            fut.set_result(None)  # the slot passes straight to the waiter
            return
        self.active -= 1

    @asynccontextmanager
    async def slot(self, priority: Priority) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()
