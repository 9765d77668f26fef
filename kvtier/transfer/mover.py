"""The mover's bookkeeping: jobs, background tasks, links and operations in flight.

Every batch runs as its own task (:class:`Job`) at a priority. A job is ``started`` once
it holds room and a link slot; from then on it is never cancelled (it finishes and
commits, or aborts cleanly), so cancelling a caller cancels only batches not yet started
(:meth:`Mover.await_jobs`). Background tasks (write-through, evictions, late prefetches)
run through :meth:`Mover.spawn`; :meth:`Mover.drain` waits for all of them.

While a page is being written into a tier or evicted from it, an *operation* is open on
(page, tier): one future per batch, shared by its pages. Other work on the same page waits
for it (:meth:`Mover.settle`) instead of racing it.

All of it lives on the event-loop thread; nothing here touches a backend.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kvtier.errors import KVTierError
from kvtier.index.directory import Directory
from kvtier.keys import PageKey
from kvtier.log import get_logger
from kvtier.metrics import CacheMetrics
from kvtier.plan.planner import Planner
from kvtier.transfer.gate import Priority
from kvtier.transfer.links import Link
from kvtier.transfer.tier import Tier

_log = get_logger("kvtier.pipeline")

T = TypeVar("T")


class Job:
    """One batch running as its own task at ``priority``; ``started`` once it holds room
    and a link slot, after which it is never cancelled (it finishes and commits or aborts
    cleanly)."""

    __slots__ = ("priority", "started", "task")

    def __init__(self, priority: Priority) -> None:
        self.priority = priority
        self.started = False
        self.task: asyncio.Task[Any] | None = None


class Mover:
    """Shared run-time state of the transfer layer for ``tiers`` (top first).

    Args:
        tiers: opened tiers, top first.
        directory: the page index (its tier names are the tiers' names).
        metrics: where counters and histograms go.
        planner: the decisions (over the same directory).
        max_inflight_per_link: batches in flight per link.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        directory: Directory,
        metrics: CacheMetrics,
        planner: Planner,
        max_inflight_per_link: int,
    ) -> None:
        self.tiers = list(tiers)
        self.directory = directory
        self.metrics = metrics
        self.planner = planner
        self.max_inflight = max_inflight_per_link
        self._links: dict[tuple[int, int], Link] = {}
        self._ops: dict[tuple[PageKey, str], asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._services: set[asyncio.Task[Any]] = set()  # see spawn
        self._jobs: set[Job] = set()

    # -- tiers and links -------------------------------------------------------------------

    @property
    def top(self) -> Tier:
        return self.tiers[0]

    def next(self, tier: Tier) -> Tier | None:
        """The tier under ``tier`` (``None`` for the last)."""
        return self.tiers[tier.index + 1] if tier.index + 1 < len(self.tiers) else None

    def link(self, src: Tier, dst: Tier) -> Link:
        """The link from ``src`` to ``dst`` (created on first use)."""
        key = (src.index, dst.index)
        link = self._links.get(key)
        if link is None:
            link = Link(src, dst, self.metrics, self.max_inflight)
            self._links[key] = link
        return link

    @property
    def links(self) -> list[Link]:
        return list(self._links.values())

    def kept(self, key: PageKey) -> bool:
        """Whether ``key`` is readable in a tier that is not taking it out (a drop, or the
        evictor once it decided the page leaves: :attr:`Tier.leaving`). An evicted page
        is kept while the tier below holds it."""
        entry = self.directory.get(key)
        return entry is not None and any(
            key not in t.leaving and entry.visible_in(t.name) for t in self.tiers
        )

    def changed(self, *tiers: Tier) -> None:
        """Occupancy of ``tiers`` may have changed: update the gauge, wake room waiters."""
        for t in tiers:
            self.metrics.used.set(self.directory.used(t.name), t.name)
            t.notify()

    # -- operations in flight ----------------------------------------------------------------

    @staticmethod
    def op_future() -> asyncio.Future[None]:
        """One future per batch, shared by its pages (resolved when the batch ends)."""
        return asyncio.get_running_loop().create_future()

    def begin_op(self, key: PageKey, tier: Tier, fut: asyncio.Future[None]) -> None:
        """Open the operation of ``fut`` on ``key`` in ``tier``."""
        op = (key, tier.name)
        if op in self._ops:  # pragma: no cover - guarded by the state checks
            raise AssertionError(f"two operations on page {key.hex()} in {tier.name}")
        self._ops[op] = fut

    def end_op(self, key: PageKey, tier: Tier) -> None:
        """Close the operation on ``key`` in ``tier`` (its waiters wake)."""
        fut = self._ops.pop((key, tier.name), None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def moving(self, key: PageKey, tiers: Sequence[Tier] | None = None) -> bool:
        """Whether ``key`` is being written into or evicted from any of ``tiers`` (all)."""
        return any((key, t.name) in self._ops for t in (tiers or self.tiers))

    async def settle(self, keys: Sequence[PageKey], tiers: Sequence[Tier] | None = None) -> None:
        """Wait until no reservation or eviction of ``keys`` is in progress in ``tiers``."""
        names = [t.name for t in (tiers if tiers is not None else self.tiers)]
        while True:
            pending = {self._ops[(k, n)] for k in keys for n in names if (k, n) in self._ops}
            if not pending:
                return
            await asyncio.wait(pending)  # never cancels the futures it waits on

    # -- jobs and background tasks -----------------------------------------------------------

    def launch(self, fn: Callable[[Job], Coroutine[Any, Any, Any]], priority: Priority) -> Job:
        """Run ``fn(job)`` as a job at ``priority``."""
        job = Job(priority)
        task = asyncio.get_running_loop().create_task(fn(job))
        job.task = task
        self._tasks.add(task)
        self._jobs.add(job)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            self._jobs.discard(job)
            if not t.cancelled() and t.exception() is not None:
                exc = t.exception()
                if not isinstance(exc, KVTierError):
                    _log.error("pipeline task failed", error=repr(exc))

        task.add_done_callback(done)
        return job

    async def await_jobs(self, jobs: Sequence[Job], *, cut: bool = False) -> list[Any]:
        """Results of ``jobs``; on cancellation, un-started jobs are cancelled and running
        ones finish in the background. Once every job has ended, the first exception one
        of them raised (a CapacityError, typically) is re-raised; with ``cut``, a job the
        caller cancelled itself is left in the results as its ``CancelledError``."""
        tasks = [j.task for j in jobs if j.task is not None]
        try:
            results = await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
        except asyncio.CancelledError:
            for j in jobs:
                if not j.started and j.task is not None:
                    j.task.cancel()
            raise
        for r in results:
            if isinstance(r, BaseException) and not (cut and isinstance(r, asyncio.CancelledError)):
                raise r
        return list(results)

    def spawn(self, coro: Coroutine[Any, Any, T], *, service: bool = False) -> asyncio.Task[T]:
        """Run ``coro`` as a background task that :meth:`drain` (and so close) awaits.
        A ``service`` (an evict worker, a background trim) serves whatever is queued
        while it runs, so under steady load it may never end: :meth:`finish_started`
        waits for its page operations, not for it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if service:
            self._services.add(task)
            task.add_done_callback(self._services.discard)
        return task

    @property
    def pending(self) -> int:
        """Jobs and background tasks not finished yet."""
        return len(self._tasks)

    def cancel_unstarted(self, priority: Priority) -> None:
        """Cancel the jobs at ``priority`` that have not started."""
        for job in list(self._jobs):
            if job.priority is priority and not job.started and job.task is not None:
                job.task.cancel()

    async def drain(self) -> None:
        """Wait until every job and background task is done.

        Cancelling the caller stops the wait only: the tasks belong to the mover and
        keep running (a started batch always finishes)."""
        while self._tasks:
            await asyncio.shield(asyncio.gather(*list(self._tasks), return_exceptions=True))

    async def finish_started(self) -> None:
        """Wait for the jobs, background tasks (write-throughs) and page operations there
        are now, not for work that starts later nor for the services (evict workers,
        trims): under steady load those are never idle, and a
        :meth:`drain` by a caller racing other callers' new work could wait for ever (a
        probe's ``flush`` under four writers timed out after 30 s, every time). Cancelling
        the caller stops the wait only."""
        pending = set(self._ops.values()) | (self._tasks - self._services)
        if pending:
            await asyncio.wait(pending)

    async def cancel_all(self) -> None:
        """Cancel every task, started batches included, and wait for their clean-up
        (reservations aborted, pages left where they were)."""
        while self._tasks:
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
