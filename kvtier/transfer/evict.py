"""The evict queue: victims written down (or dropped) by a background task per tier.

Victims are chosen by the planner; :meth:`Evictor.submit` marks them ``evicting`` at once
(nothing can start copying them meanwhile) and queues them on their tier. A worker task
per tier (up to ``max_workers`` at once) takes everything queued so far and evicts it as
one group: each victim goes where :meth:`~kvtier.plan.planner.Planner.evict_plan` says
(already held below: just freed; down to the next tier, written first; or dropped), then
the backend deletes it and the index forgets it. Eviction runs in its own task, so a
cancelled caller never cuts it short.

A victim whose write-down fails stays where it is (nothing committed is lost), and so does
one the backend fails to delete (the index never forgets a page still held), one a load
pinned while it was being written down (the load finds it where it was), and one the
policy wants kept by the time it would leave (leaf-first: a child landed meanwhile); all
of them are reported *stuck*. :meth:`Evictor.evict` awaits a group (a room-making caller
evicting synchronously); :meth:`Evictor.trim` brings a tier that landed above its high
watermark back to its low watermark, awaiting it or (with the background evictor) not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.errors import CapacityError
from kvtier.health import LogEvery
from kvtier.index.directory import Directory, PageState
from kvtier.keys import PageKey
from kvtier.log import get_logger
from kvtier.plan.planner import Spare
from kvtier.transfer.batch import forget
from kvtier.transfer.gate import Priority
from kvtier.transfer.mover import Mover
from kvtier.transfer.tier import Tier

_log = get_logger("kvtier.pipeline")

#: Seconds between two "write-down blocked" lines of one pair of tiers, and between two
#: "write-through blocked" lines of one tier (the rest are counted).
BLOCKED_LOG_INTERVAL_S = 60.0

#: How long a wait for room (or a background trim waiting for busy pages) sleeps at most
#: before re-checking (a safety net: every change that frees room also wakes waiters).
WAIT_RECHECK_S = 0.05

#: Copies ``keys`` from the first tier to the second at a priority (pages being evicted);
#: ``True`` where the lower tier holds the page afterwards.
WriteDown = Callable[[Tier, Tier, list[PageKey], Priority], Awaitable[list[bool]]]


class Evicted(NamedTuple):
    """The victims of one eviction that stayed in their tier, and among them those that
    *could not* leave (their write-down failed or the backend failed to delete them; the
    others stayed because a load pinned them or the policy wanted them kept by then)."""

    stay: set[PageKey]
    failed: set[PageKey]


@dataclass
class _Group:
    """Victims submitted together, the future of their stuck subset, and the victims the
    policy was ready to give up when they were chosen (if one of those changes its mind
    before it leaves, it stays: leaf-first, a child landed meanwhile)."""

    keys: list[PageKey]
    priority: Priority
    done: asyncio.Future[Evicted]
    watched: set[PageKey]
    spare: Collection[PageKey]


@dataclass
class _Queue:
    pending: list[_Group] = field(default_factory=list)
    workers: int = 0


class Evictor:
    """The evict queues of every tier of ``mover``.

    Args:
        mover: the shared transfer state.
        write_down: how victims are copied to the tier below.
        background: whether trims after landing run in the background (the evict queue
            keeps tiers between their watermarks ahead of demand) instead of being awaited.
        max_workers: eviction groups running at once per tier.
    """

    def __init__(
        self, mover: Mover, write_down: WriteDown, *, background: bool, max_workers: int = 2
    ) -> None:
        self.mover = mover
        self.write_down = write_down
        self.background = background
        self.max_workers = max(1, max_workers)
        self._queues = [_Queue() for _ in mover.tiers]
        self._trimming = [False for _ in mover.tiers]
        self._trim_again = [False for _ in mover.tiers]
        self._kept_by_policy = 0
        self._trim_spare: list[set[PageKey]] = [set() for _ in mover.tiers]
        #: "write-down blocked" at most once a minute per pair of tiers (a hierarchy
        #: stuck full logged ~40,000 lines in 80 s)
        self._blocked = LogEvery(BLOCKED_LOG_INTERVAL_S)

    def queued(self, tier: Tier) -> int:
        """Victims of ``tier`` waiting for a worker."""
        return sum(len(g.keys) for g in self._queues[tier.index].pending)

    def submit(
        self,
        tier: Tier,
        victims: Sequence[PageKey],
        priority: Priority = Priority.EVICT,
        spare: Collection[PageKey] = (),
    ) -> asyncio.Future[Evicted]:
        """Queue ``victims`` (committed, evictable) for eviction from ``tier``; they are
        marked ``evicting`` before this returns. The future answers the victims that stay
        and those that could not leave (see :class:`Evicted`). ``spare``: what the caller
        protects; should victims stay and leave the tier above its high watermark, the
        tier is trimmed sparing it."""
        mover = self.mover
        d = mover.directory
        busy = [k for k in victims if mover.moving(k, (tier,))]
        if busy:  # checked before anything changes: a bug here must raise, never hang
            raise AssertionError(
                f"{len(busy)} victim(s) in {tier.name} are already being moved "
                f"(first {busy[0].hex()}): the planner named a page that is not evictable"
            )
        op = mover.op_future()
        for k in victims:
            d.begin_evict(k, tier.name)
            mover.begin_op(k, tier, op)
        done: asyncio.Future[Evicted] = asyncio.get_running_loop().create_future()
        done.add_done_callback(_retrieve)
        queue = self._queues[tier.index]
        planner = mover.planner
        watched = {k for k in victims if not planner.keeps(tier.index, k)}
        queue.pending.append(_Group(list(victims), priority, done, watched, spare))
        if queue.workers < self.max_workers:
            queue.workers += 1
            mover.spawn(self._work(tier, queue), service=True)
        return done

    async def evict(
        self, tier: Tier, victims: Sequence[PageKey], priority: Priority = Priority.EVICT
    ) -> set[PageKey]:
        """Evict ``victims`` from ``tier`` and wait for it; returns those that stay. A
        cancelled caller stops waiting; the eviction goes on."""
        return (await self.evict_reporting(tier, victims, priority)).stay

    async def evict_reporting(
        self, tier: Tier, victims: Sequence[PageKey], priority: Priority = Priority.EVICT
    ) -> Evicted:
        """:meth:`evict`, telling the victims that could not leave from those that stayed
        because a load pinned them or the policy kept them (a caller making room retries
        past the latter and gives up only on the former)."""
        return await asyncio.shield(self.submit(tier, victims, priority))

    async def trim(
        self, tier: Tier, priority: Priority = Priority.EVICT, protect: Collection[PageKey] = ()
    ) -> None:
        """Bring ``tier`` back to its low watermark after batches landed above its high one,
        sparing ``protect`` (what a fetch brought up for its caller).

        Room is claimed before batches land, but concurrent batches can each find the tier
        held up by pins, claim room above the watermark, and land; once they have, their
        pages are evictable. Victims are evicted until the tier is back or every victim of
        a round stayed; with the background evictor that runs as a background task (at
        eviction priority) and this returns at once.
        """
        if self.mover.directory.used(tier.name) <= tier.high_pages:
            return
        if not self.background:
            await self._trim(tier, priority, protect, wait=False)
            return
        # one background trim per tier: later requests add what they protect to it
        spare = self._trim_spare[tier.index]
        spare.update(protect)
        if self._trimming[tier.index]:
            self._trim_again[tier.index] = True  # things changed: another round after this
        else:
            self._trimming[tier.index] = True
            self.mover.spawn(self._background_trim(tier), service=True)

    async def _background_trim(self, tier: Tier) -> None:
        i = tier.index
        try:
            while True:
                self._trim_again[i] = False
                await self._trim(tier, Priority.EVICT, self._trim_spare[i], wait=True)
                if not self._trim_again[i]:
                    return
        finally:
            self._trimming[i] = False
            self._trim_spare[i] = set()

    async def _trim(
        self, tier: Tier, priority: Priority, protect: Collection[PageKey], wait: bool
    ) -> None:
        """Evict until ``tier`` is at or under its high watermark or a round's victims all
        stay. With ``wait`` (the background evictor), pages that are not evictable yet
        because work on them is under way (copies, write-downs, evictions) are waited
        for instead of given up on."""
        mover = self.mover
        d = mover.directory
        planner = mover.planner
        spare = Spare(protect, set())
        while True:
            if tier.skips_write_downs(mover.next(tier)):
                planner.skip_write_downs(tier.index, spare)
            victims = planner.trim_victims(tier.index, spare)
            if not victims:
                if not wait or d.used(tier.name) <= tier.high_pages:
                    return
                if not (d.evicting(tier.name) + tier.reserving + d.busy(tier.name) + tier.claimed):
                    return
                await tier.wait_change(WAIT_RECHECK_S)
                continue
            stuck = await self.evict(tier, victims, priority)
            if len(stuck) == len(victims):
                return

    async def _work(self, tier: Tier, queue: _Queue) -> None:
        """Evict what is queued on ``tier``, group after group, until nothing is left."""
        try:
            while queue.pending:
                groups, queue.pending = queue.pending, []
                keys = [k for g in groups for k in g.keys]
                try:
                    watched = set().union(*(g.watched for g in groups))
                    prio = min(g.priority for g in groups)
                    stuck, failed = await self._evict(tier, keys, prio, watched)
                except BaseException as exc:
                    for g in groups:
                        if not g.done.done():
                            g.done.set_exception(exc)
                    raise
                for g in groups:
                    if not g.done.done():
                        g.done.set_result(
                            Evicted(
                                {k for k in g.keys if k in stuck},
                                {k for k in g.keys if k in failed},
                            )
                        )
                kept = self._kept_by_policy
                self._kept_by_policy = 0
                # progress, or the policy changed its mind (a child landed): go on if need be
                if self.background and (len(stuck) < len(keys) or kept):
                    await self.trim(
                        tier, Priority.EVICT, frozenset().union(*(g.spare for g in groups))
                    )
        finally:
            queue.workers -= 1
            if queue.workers == 0 and queue.pending:  # cancelled: nothing may stay evicting
                groups, queue.pending = queue.pending, []
                for g in groups:
                    self.release(tier, g.keys)
                    if not g.done.done():
                        g.done.cancel()

    def release(self, tier: Tier, victims: Sequence[PageKey]) -> None:
        """End the eviction of ``victims`` (marked ``evicting``): those still marked go back
        to ``committed``, their operations close and room waiters wake."""
        d = self.mover.directory
        for k in victims:
            if d.state(k, tier.name) is PageState.EVICTING:
                d.cancel_evict(k, tier.name)
            self.mover.end_op(k, tier)
        self.mover.changed(tier)

    async def _evict(
        self,
        tier: Tier,
        victims: list[PageKey],
        priority: Priority,
        watched: set[PageKey] = frozenset(),  # type: ignore[assignment]
    ) -> tuple[set[PageKey], set[PageKey]]:
        """Evict ``victims`` (marked ``evicting``) from ``tier``; returns those that stay
        (their write-down failed, the backend failed to delete them, a load pinned them
        meanwhile, or, for ``watched`` victims, the policy wants them kept by now) and,
        among them, those that could not leave (the first two reasons)."""
        mover = self.mover
        d = mover.directory
        stuck: set[PageKey] = set()
        failed: set[PageKey] = set()
        released: set[PageKey] = set()
        try:
            planner = mover.planner
            plan = planner.evict_plan(tier.index, victims)
            nxt = mover.next(tier)
            if plan.down and nxt is not None:
                try:
                    ok = await self.write_down(tier, nxt, plan.down, priority)
                    stuck = {k for k, o in zip(plan.down, ok, strict=True) if not o}
                    failed |= stuck
                    if stuck:
                        tier.down_failed_at = time.monotonic()
                except CapacityError as exc:
                    # No room below: what fills it is pinned, or (leaf-first) every page
                    # there has a descendant up here. Victims no cached page depends on
                    # leave the hierarchy, as the last tier would drop them (else such a
                    # hierarchy never frees itself); the others stay without having
                    # failed: room may be made below once these are gone.
                    gone = planner.droppable(tier.index, plan.down)
                    plan.drop.extend(k for k in plan.down if k in gone)
                    stuck = {k for k in plan.down if k not in gone}
                    # dropping tails is leaf-first's normal way out: no warning for it
                    log = _log.info if gone else _log.warning
                    held = self._blocked.due(f"{tier.name}->{nxt.name}")
                    if held is not None:
                        log(
                            "write-down blocked",
                            tier=nxt.name,
                            reason=str(exc),
                            dropped=len(gone),
                            staying=len(stuck),
                            held_back=held,
                        )
            kept = {k for k in watched if planner.keeps(tier.index, k)}
            self._kept_by_policy += len(kept)
            stuck |= kept
            stuck |= {k for k in victims if d.is_pinned(k)}  # a load pinned it meanwhile
            if stuck and tier.policy.keeps_parents:  # a parent never leaves before its child
                stuck |= _ancestors_among(d, stuck, set(victims))
            keep = [k for k in victims if k in stuck]
            go = [k for k in victims if k not in keep]
            # the pages that stay are committed again from here on, so their operation
            # ends now, before the awaits below: a committed page with an operation open
            # could be named a victim by someone else meanwhile (two operations on one
            # page), and whoever settles on it would wait for pages it is not waiting for
            self.release(tier, keep)
            released.update(keep)
            if go:
                # decided in the same step as the pin check above: a load pinning one of
                # these from now on waits for it to leave (Tier.stays)
                tier.leaving.update(go)
                try:
                    lingering = await forget(mover, tier, go)
                finally:
                    tier.leaving.difference_update(go)
                stuck |= lingering
                failed |= lingering
                go = [k for k in go if k not in lingering]
            if go:
                mover.metrics.evicted.inc(tier.name, by=len(go))
                dropping = set(plan.drop)
                dropped = sum(1 for k in go if k in dropping)
                if dropped:
                    mover.metrics.dropped.inc(tier.name, by=dropped)
            return stuck, failed
        finally:
            self.release(tier, [k for k in victims if k not in released])


def _retrieve(fut: asyncio.Future[Evicted]) -> None:
    """Mark a group's exception as seen (groups queued in the background are not awaited)."""
    if not fut.cancelled():
        fut.exception()


def _ancestors_among(d: Directory, keys: set[PageKey], victims: set[PageKey]) -> set[PageKey]:
    """The victims that are ancestors (through recorded parents) of ``keys``."""
    out: set[PageKey] = set()
    todo = list(keys)
    while todo:
        entry = d.get(todo.pop())
        parent = entry.parent if entry is not None else None
        if parent is not None and parent in victims and parent not in out:
            out.add(parent)
            todo.append(parent)
    return out
