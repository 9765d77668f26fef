"""The write path: store pages in the top tier, copy them down per the write policy, flush.

:meth:`Writer.store` commits the caller's pages to the top tier in batches (room claimed
first come first served, victims to the evict queue); the write policy then copies them
down in the background (write-through, or selective for admitted pages; write-back
leaves them to eviction). :meth:`Writer.flush` writes every dirty page of a memory tier
(held there and in no lower tier) one tier down, as the write policy allows.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from kvtier.aio import finish_before_raising
from kvtier.errors import CapacityError
from kvtier.health import LogEvery
from kvtier.index.directory import PageState
from kvtier.keys import PageKey
from kvtier.log import get_logger
from kvtier.transfer.batch import purge_vanished
from kvtier.transfer.evict import BLOCKED_LOG_INTERVAL_S
from kvtier.transfer.gate import Priority
from kvtier.transfer.mover import Job, Mover
from kvtier.transfer.moves import Moves
from kvtier.transfer.tier import Tier

_log = get_logger("kvtier.pipeline")


#: Removes pages from a tier without writing them down, those the filter (called as the
#: removal begins) still picks; returns those removed.
Drop = Callable[
    [Tier, list[PageKey], Callable[[list[PageKey]], list[PageKey]]], Awaitable[list[PageKey]]
]


class Writer:
    """Stores, write-downs and flushes over ``mover`` with batches from ``moves``;
    ``drop`` removes what a store committed past a page it could not keep."""

    def __init__(self, mover: Mover, moves: Moves, drop: Drop) -> None:
        self.mover = mover
        self.moves = moves
        self.drop = drop
        #: "write-through blocked" and "flush could not write every dirty page down" at
        #: most once a minute per tier
        self._blocked = LogEvery(BLOCKED_LOG_INTERVAL_S)

    async def store(
        self,
        keys: Sequence[PageKey],
        bufs: Sequence[np.ndarray],
        parents: Sequence[PageKey | None],
        namespace: str,
    ) -> list[bool]:
        """Commit pages to the top tier (buffers already validated); write-through/
        selective policies then copy them down in the background.

        The pages a shared tier below counts (a pool that may have lost them) stay in
        the tiers above it until the write-through has checked them (:meth:`Planner.hold
        <kvtier.plan.planner.Planner.hold>`): counted there, a page leaving the top tier
        before would be dropped as clean."""
        mover = self.mover
        planner = mover.planner
        top = mover.top
        pools = self._pools_below(top)
        held: list[PageKey] = []
        if planner.write_policy.copies_on_store and pools:
            held = planner.hold(self._counted_in_a_pool(pools, keys), pools[0].index)
        try:
            out, down = await self._store(keys, bufs, parents, namespace, bool(pools))
        except BaseException:
            planner.unhold(held)
            raise
        if down:
            planner.checks_running += len(held)
            task = mover.spawn(self.write_through(top, down))
            if held:  # a callback: runs even for a task cancelled before it started
                task.add_done_callback(lambda _task: self._checked(held))
        else:
            planner.unhold(held)
        return out

    async def _store(
        self,
        keys: Sequence[PageKey],
        bufs: Sequence[np.ndarray],
        parents: Sequence[PageKey | None],
        namespace: str,
        pool_below: bool,
    ) -> tuple[list[bool], list[PageKey]]:
        """:meth:`store`'s work; returns what it stored and the pages to copy down
        (``pool_below``: a shared tier lies below the top one)."""
        mover = self.mover
        planner = mover.planner
        top = mover.top
        d = mover.directory
        n = len(keys)
        out = [False] * n
        await mover.settle(keys, [top])
        first: dict[PageKey, int] = {}
        todo: list[int] = []
        for i, k in enumerate(keys):
            if k in first:
                continue
            first[k] = i
            planner.note_store(k, parents[i])
            if d.state(k, top.name) is PageState.COMMITTED:
                planner.note_access(top.index, k)
                out[i] = True
            else:
                todo.append(i)
        jobs: list[tuple[list[int], Job]] = []
        size = planner.batch_size(top.index)
        # until every batch has landed, the last tier keeps the pages they extend (their
        # children are not cached yet, so leaf-first would take them for leaves)
        expected = planner.expect(parents[i] for i in todo)
        try:
            for start in range(0, len(todo), size):
                idx = todo[start : start + size]
                job = self.moves.launch(
                    None,
                    top,
                    [keys[i] for i in idx],
                    Priority.FETCH,
                    data=[bufs[i] for i in idx],
                    parents=[parents[i] for i in idx],
                    namespace=namespace,
                )
                jobs.append((idx, job))
            self._cut_after_gaps(jobs, keys, parents)
            results = await mover.await_jobs([j for _, j in jobs], cut=True)
        except BaseException:
            # cancelled (or failed): batches that started still land, in the background
            mover.spawn(self._finish_abandoned(keys, parents, first, todo, jobs, expected))
            # ... but they copy from the caller's buffers: the caller may reuse those as
            # soon as this raises, so wait for the batches (un-started ones were cancelled)
            await finish_before_raising([j.task for _, j in jobs if j.task is not None])
            raise
        planner.unexpect(expected)
        await self._settle(out, keys, parents, first, todo, jobs, results)
        for i, k in enumerate(keys):
            out[i] = out[first[k]]
        if d.used(top.name) > top.high_pages:
            await self.moves.evictor.trim(top, Priority.FETCH)
        stored = [keys[i] for i in todo if out[i]]
        down: list[PageKey] = []
        if planner.write_policy.copies_on_store and len(mover.tiers) > 1:
            # pages this process holds already go down again too when a shared pool lies
            # below: the pool may have lost them meanwhile (write_through checks)
            done = set(stored)
            again = [k for k, i in first.items() if out[i] and k not in done]
            down = stored + again if pool_below else stored
        return out, down

    def _cut_after_gaps(
        self,
        jobs: list[tuple[list[int], Job]],
        keys: Sequence[PageKey],
        parents: Sequence[PageKey | None],
    ) -> None:
        """Once a batch of this store ends with a page stored nowhere, the batches not
        started yet whose pages all follow it in the call's chain are cancelled: they
        could only land orphans, which :meth:`_settle` removes again. A store far longer
        than the hierarchy made each such batch wait its turn for room, and the calls
        queued behind it waited minutes (a docs-only probe: 70 s, two stores of 23,000
        and 28,500 pages over 268 pages)."""

        def ended(idx: list[int], task: asyncio.Task[Any]) -> None:
            if task.cancelled():
                return
            res = None if task.exception() is not None else task.result()
            gaps = {keys[i] for n, i in enumerate(idx) if res is None or not res[n]}
            lost = {k for k in gaps if not self.mover.kept(k)}
            if not lost:
                return
            _followers(keys, parents, lost)
            for later, job in jobs:
                t = job.task
                if t is not None and not job.started and all(keys[i] in lost for i in later):
                    t.cancel()

        for idx, job in jobs:
            if job.task is not None:
                job.task.add_done_callback(functools.partial(ended, idx))

    def _counted_in_a_pool(self, pools: list[Tier], keys: Sequence[PageKey]) -> list[PageKey]:
        """``keys`` (once each) that one of ``pools`` counts as committed."""
        d = self.mover.directory
        return [
            k
            for k in dict.fromkeys(keys)
            if any(d.state(k, p.name) is PageState.COMMITTED for p in pools)
        ]

    def _checked(self, held: list[PageKey]) -> None:
        """The write-through that checked ``held`` ended: the tiers may evict them again
        (the next call that needs room trims a tier they held above its watermark)."""
        self.mover.planner.unhold(held, running=True)
        self.mover.changed(*self.mover.tiers)  # room waits may go on

    def _pools_below(self, tier: Tier) -> list[Tier]:
        """The tiers below ``tier`` that other servers share (remote pools), top first."""
        tiers = self.mover.tiers
        return [t for t in tiers[tiers.index(tier) + 1 :] if t.backend.shared]

    async def _finish_abandoned(
        self,
        keys: Sequence[PageKey],
        parents: Sequence[PageKey | None],
        first: dict[PageKey, int],
        todo: list[int],
        jobs: list[tuple[list[int], Job]],
        expected: list[PageKey],
    ) -> None:
        """The rest of a store whose caller stopped waiting (cancelled, or an error):
        once its batches have ended (started ones always finish), the last tier may drop
        the pages they extend again, and the pages they committed past a page of the
        store cached nowhere are removed, as :meth:`store` does for its own."""
        tasks = [j.task for _, j in jobs if j.task is not None]
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self.mover.planner.unexpect(expected)
        await self._settle([False] * len(keys), keys, parents, first, todo, jobs, results)

    async def _settle(
        self,
        out: list[bool],
        keys: Sequence[PageKey],
        parents: Sequence[PageKey | None],
        first: dict[PageKey, int],
        todo: list[int],
        jobs: list[tuple[list[int], Job]],
        results: Sequence[Any],
    ) -> None:
        """Set ``out[i]`` for the pages of each job from its result (a job that raised,
        or was cancelled, stored none of its pages), then mark not stored every page past
        a page of this store that is cached nowhere (:meth:`_past_a_gap`), and remove
        those this store committed: the batches ran side by side, one may have landed
        after one before it failed.

        Stores of the same pages run side by side too. A page one of them found
        committed may be another's orphan, and a page's gap may be filled by another
        store while it settles. So the removal takes only pages still past a gap when it
        begins, and last, a page no tier keeps any more (another store removed it) is
        marked not stored: what a store reports stored is never an orphan someone removes.
        """
        for (idx, _), res in zip(jobs, results, strict=True):
            if not isinstance(res, BaseException):
                for i, r in zip(idx, res, strict=True):
                    out[i] = r
        lost = self._past_a_gap(keys, parents, first)
        mine = [keys[i] for i in todo if out[i] and keys[i] in lost]
        if mine:

            def still_past_a_gap(ks: list[PageKey]) -> list[PageKey]:
                now = self._past_a_gap(keys, parents, first)
                return [k for k in ks if k in now]

            await self.drop(self.mover.top, mine, still_past_a_gap)
        kept = self.mover.kept
        for k, i in first.items():
            if out[i] and (k in lost or not kept(k)):
                out[i] = False

    def _past_a_gap(
        self,
        keys: Sequence[PageKey],
        parents: Sequence[PageKey | None],
        first: dict[PageKey, int],
    ) -> set[PageKey]:
        """The pages of ``keys`` that follow, in the chain the call gave, a page of the
        same call that no tier keeps now (:meth:`Mover.kept`): no lookup reaches them, so
        they would only take room. A parent outside the call is not judged (another call
        may be storing it)."""
        kept = self.mover.kept
        gaps = {p for p in parents if p is not None and p in first and not kept(p)}
        lost = _followers(keys, parents, gaps)
        return {k for p, k in zip(parents, keys, strict=True) if p in lost}

    async def write_through(self, src: Tier, keys: list[PageKey]) -> None:
        """Copy freshly stored pages down the hierarchy (background).

        A shared tier (a pool other servers use: ``Backend.shared``) may have lost pages
        this process counts as there (a server restart or flush, its own LRU, another
        server's delete). Its pages among ``keys`` are checked first (one ``contains``),
        and those gone are forgotten and copied again: a store publishes its pages to the
        pool again, as a prefill server handing pages to decode servers relies on. Pages
        the next tier holds already continue down when a shared tier lies further below.
        """
        mover = self.mover
        dst = mover.next(src)
        if dst is None or not keys:
            return
        d = mover.directory
        if dst.backend.shared:
            held = [k for k in keys if d.state(k, dst.name) is PageState.COMMITTED]
            if held:
                await purge_vanished(mover, dst, held)
        todo = mover.planner.write_through(src.index, keys)
        await mover.settle(todo, [dst])
        todo = [k for k in todo if d.state(k, dst.name) is None and d.is_committed(k, src.name)]
        landed: list[PageKey] = []
        if todo:
            try:
                ok = await self.moves.copy(src, dst, todo, Priority.EVICT)
            except CapacityError as exc:
                held_back = self._blocked.due(dst.name)  # it repeats on every store
                if held_back is not None:
                    _log.warning(
                        "write-through blocked: pages stay dirty",
                        tier=dst.name,
                        reason=str(exc),
                        held_back=held_back,  # lines like this one not logged since the last
                    )
                return
            landed = [k for k, o in zip(todo, ok, strict=True) if o]
        if self._pools_below(dst):
            copied = set(landed)
            landed += [k for k in keys if k not in copied and d.is_committed(k, dst.name)]
        if landed:
            await self.write_through(dst, landed)

    async def flush(self) -> int:
        """Finish the work in progress (:meth:`~kvtier.transfer.mover.Mover.finish_started`:
        not work other callers start meanwhile), then write every dirty page of a memory
        tier (held there and in no lower tier) down one tier, as the write policy allows.
        Pages stay where they are. Returns the pages written down. Background work the
        flush itself set off (a trim below) may still run when it returns."""
        mover = self.mover
        await mover.finish_started()
        written = 0
        d = mover.directory
        for tier in mover.tiers[:-1]:
            if not tier.is_arena:
                continue
            nxt = mover.tiers[tier.index + 1]
            dirty = mover.planner.dirty(tier.index, d.keys_in(tier.name))
            if not dirty:
                continue
            try:
                ok = await self.moves.copy(tier, nxt, dirty, Priority.EVICT)
            except CapacityError as exc:
                _log.warning("flush blocked: pages stay dirty", tier=nxt.name, reason=str(exc))
                continue
            written += sum(ok)
            held_back = None if all(ok) else self._blocked.due(f"flush:{tier.name}")
            if held_back is not None:  # a flush per call under a dead tier: 4,800 a minute
                _log.warning(
                    "flush could not write every dirty page down",
                    tier=tier.name,
                    to=nxt.name,
                    failed=len(ok) - sum(ok),
                    held_back=held_back,  # lines like this one not logged since the last
                )
        await mover.finish_started()
        return written


def _followers(
    keys: Sequence[PageKey], parents: Sequence[PageKey | None], lost: set[PageKey]
) -> set[PageKey]:
    """Add to ``lost`` the pages of ``keys`` that follow one of its pages in the chain the
    call gave (``parents[i]`` is the page before ``keys[i]``); returns ``lost``."""
    for i, k in enumerate(keys):
        if parents[i] in lost:
            lost.add(k)
    return lost
