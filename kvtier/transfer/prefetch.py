"""Prefetches: bring pages to the top tier ahead of need, and report what arrived in time.

A prefetch groups its pages by the tier to read them from (the planner's
:meth:`~kvtier.plan.planner.Planner.source`) and runs each batch as a job at prefetch
priority (after demand fetches, before evictions at every link). At the deadline it
returns: pages in the top tier *arrived*, pages still moving are *late* (they keep moving
in the background), the rest are *missing*. Pages already on their way up (or out) are
waited for, then brought up if they did not end there. Cancelling the caller cancels the
batches not yet started.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Collection, Sequence
from numbers import Real

import numpy as np

from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.transfer.gate import Priority
from kvtier.transfer.mover import Job, Mover
from kvtier.transfer.moves import Moves
from kvtier.transfer.results import PrefetchResult


def _deadline(deadline_s: float) -> float:
    """``deadline_s`` as a timeout; raises :class:`KVTierUsageError` for a bad one."""
    if (
        isinstance(deadline_s, bool | np.bool_)
        or not isinstance(deadline_s, Real)  # numpy's numbers too, as hint values
        or not deadline_s >= 0  # also NaN
    ):
        raise KVTierUsageError(
            f"deadline_s must be >= 0 (seconds, a real number), got {deadline_s!r}"
        )
    try:
        return float(deadline_s)
    except OverflowError:  # an int past the float range: no deadline
        return math.inf


class Prefetcher:
    """Prefetches over ``mover`` with batches from ``moves``."""

    def __init__(self, mover: Mover, moves: Moves) -> None:
        self.mover = mover
        self.moves = moves

    async def prefetch(self, keys: Sequence[PageKey], deadline_s: float) -> PrefetchResult:
        """Start bringing ``keys`` to the top tier and return what arrived by the deadline.

        Pages still moving at the deadline keep moving in the background and are
        reported ``late``. Cancelling the caller cancels the batches not yet started.
        """
        timeout = _deadline(deadline_s)
        mover = self.mover
        planner = mover.planner
        top = mover.top
        d = mover.directory
        uniq = list(dict.fromkeys(keys))
        wanted = frozenset(uniq)
        arrived: list[PageKey] = []
        missing: list[PageKey] = []
        groups: dict[int, list[PageKey]] = {}
        waiting: list[PageKey] = []
        for k in uniq:
            if d.is_committed(k, top.name):
                arrived.append(k)
            elif mover.moving(k, [top]):
                waiting.append(k)  # already on its way up (or out): wait for it
            elif (src := planner.source(k)) is not None:
                groups.setdefault(src, []).append(k)
            else:
                missing.append(k)
        batches: list[tuple[list[PageKey], Job]] = []
        for idx, group in groups.items():
            src_tier = mover.tiers[idx]
            for batch in mover.planner.batches(top.index, group):
                job = self.moves.launch(src_tier, top, batch, Priority.PREFETCH, protect=wanted)
                batches.append((batch, job))
        if waiting:
            job = mover.launch(lambda _: self._after_moves(waiting, wanted), Priority.PREFETCH)
            batches.append((waiting, job))
        tasks = {j.task: (b, j) for b, j in batches if j.task is not None}
        late: list[PageKey] = []
        if tasks:
            try:
                done, pending = await asyncio.wait(list(tasks), timeout=timeout)
            except asyncio.CancelledError:
                for _, j in tasks.values():
                    if not j.started and j.task is not None:
                        j.task.cancel()
                mover.metrics.prefetch_pages.inc("cancelled", by=len(uniq) - len(arrived))
                raise
            for t in pending:
                late.extend(tasks[t][0])
            for t in done:
                batch = tasks[t][0]
                if t.cancelled() or t.exception() is not None:
                    missing.extend(batch)
                    continue
                for k in batch:
                    (arrived if d.is_committed(k, top.name) else missing).append(k)
        if d.used(top.name) > top.high_pages:  # in the background: the deadline is met
            mover.spawn(self.moves.evictor.trim(top, Priority.EVICT, wanted))
        mover.metrics.prefetch_pages.inc("arrived", by=len(arrived))
        mover.metrics.prefetch_pages.inc("late", by=len(late))
        mover.metrics.prefetch_pages.inc("missing", by=len(missing))
        return PrefetchResult(arrived, late, missing)

    async def _after_moves(self, keys: list[PageKey], wanted: Collection[PageKey]) -> None:
        """Wait for the operations already under way on ``keys`` in the top tier (a fetch
        or an eviction), then bring up those that did not end there."""
        mover = self.mover
        top = mover.top
        await mover.settle(keys, [top])
        groups: dict[int, list[PageKey]] = {}
        for k in keys:
            if not mover.directory.is_committed(k, top.name):
                src = mover.planner.source(k)
                if src is not None:
                    groups.setdefault(src, []).append(k)
        jobs = [
            self.moves.launch(mover.tiers[idx], top, batch, Priority.PREFETCH, protect=wanted)
            for idx, group in groups.items()
            for batch in mover.planner.batches(top.index, group)
        ]
        await mover.await_jobs(jobs)
