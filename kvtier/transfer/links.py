"""Links: batched page movers between two tiers, and the priority gate bounding them.

A :class:`Link` moves a batch of pages from a source tier to space already reserved in a
destination tier, choosing the copy path by the kinds of the two backends:

* arena -> any: the destination writes straight from the source's slot views (zero-copy
  on the source side);
* store -> arena: the store reads straight into the reserved slot views (the arena's
  ``write`` then skips the copy);
* store -> store: through staging buffers allocated per batch.

Each backend call covers the whole batch (one executor hop per batch, never per page).
Every transfer reports pages, bytes and seconds to the metrics, so bandwidth per link
comes free. A link never raises for I/O trouble: failures are per-page ``False`` results
and the failing tier is marked (logged once per outage).

The :class:`PriorityGate` bounds the batches in flight on a link and hands free slots to
waiters by priority: demand fetch, then prefetch, then eviction / write-down.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from enum import IntEnum
from typing import Any

import numpy as np

from kvtier.backend import Reservation
from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.metrics import CacheMetrics
from kvtier.transfer.tier import Tier


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


class Link:
    """Moves batches of pages from ``src`` to reserved space in ``dst``.

    Args:
        src: source tier (pages committed there, protected by the caller while copied).
        dst: destination tier (space reserved by the caller).
        metrics: where transfers are recorded, as ``"src->dst"``.
        max_inflight: batches in flight at once on this link.
    """

    def __init__(self, src: Tier, dst: Tier, metrics: CacheMetrics, max_inflight: int) -> None:
        self.src = src
        self.dst = dst
        self.name = f"{src.name}->{dst.name}"
        self.metrics = metrics
        self.gate = PriorityGate(max_inflight, metrics)

    async def transfer(
        self, keys: Sequence[PageKey], reservations: Sequence[Reservation]
    ) -> list[bool]:
        """Copy each page into its reservation (``write``, not commit); per-page results.

        Never raises for I/O failures (they are ``False`` and mark the tier that failed);
        usage errors (wrong buffers) propagate, since they are bugs.
        """
        n = len(keys)
        if n == 0:
            return []
        page_bytes = self.dst.backend.page_bytes
        start = time.perf_counter()
        ok = [False] * n
        bufs: list[Any] = [None] * n
        readable = [False] * n
        try:
            if self.src.is_arena:
                arena = self.src.arena
                for i, key in enumerate(keys):
                    slot = arena.slot_of(key)
                    if slot is not None:
                        bufs[i] = arena.view(slot)
                        readable[i] = True
            else:
                if self.dst.is_arena and all(r.view is not None for r in reservations):
                    targets: list[Any] = [r.view for r in reservations]
                else:
                    staging = np.empty((n, page_bytes), dtype=np.uint8)
                    targets = list(staging)
                got = await self.src.backend.get(keys, targets)
                for i, hit in enumerate(got):
                    if hit:
                        bufs[i] = targets[i]
                        readable[i] = True
                self._health(self.src, "get", n - sum(got), n)
        except KVTierUsageError:
            raise
        except Exception as exc:  # a failing tier is a miss, never a crash
            self.src.record_failure("get", n, exc)
            self.metrics.failed.inc(self.src.name, by=n)
            readable = [False] * n
        idx = [i for i in range(n) if readable[i]]
        if idx:
            try:
                written = await self.dst.backend.write(
                    [reservations[i] for i in idx], [bufs[i] for i in idx]
                )
                for i, w in zip(idx, written, strict=True):
                    ok[i] = w
                self._health(self.dst, "write", len(idx) - sum(written), len(idx))
            except KVTierUsageError:
                raise
            except Exception as exc:
                self.dst.record_failure("write", len(idx), exc)
                self.metrics.failed.inc(self.dst.name, by=len(idx))
        moved = sum(ok)
        seconds = time.perf_counter() - start
        self.metrics.record_transfer(self.name, moved, moved * page_bytes, seconds)
        if moved < n:
            self.metrics.link_failed.inc(self.name, by=n - moved)
        return ok

    def _health(self, tier: Tier, op: str, failed: int, total: int) -> None:
        if failed:
            self.metrics.failed.inc(tier.name, by=failed)
        if total and failed == total:
            tier.record_failure(op, failed)
        elif failed < total:
            tier.record_success()
