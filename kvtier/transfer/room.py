"""Room in a tier, handed out first come, first served.

Before a batch takes room in a tier it *claims* it (:meth:`Room.claim`; a batch moving
pages claims only for those the tier does not hold when its turn comes,
:meth:`Room.claim_missing`); the claim becomes reservations when the batch reserves.
Callers waiting for room queue per tier and are served in arrival order: only the head
of the queue may claim or make room; everyone behind it waits its turn, so a caller that
arrived first is never overtaken by later ones (the unfairness of re-checking after each
wake-up, where 240 concurrent stores saw a p99 of 35 s, is gone).

The head asks the planner. When the pages fit under the high watermark it claims at once.
Otherwise the planner names victims, and:

* with the background evictor, when the pages still fit in the tier's capacity, the
  victims are queued for eviction and the claim is granted at once: the tier goes above
  its high watermark for the time the write-downs take, and the evict queue brings it
  back down (a fetch does not wait for the write-down of its victims);
* otherwise (no room left, or the background evictor off) the head evicts them and waits
  (the last resort; write-downs then run at the caller's priority).

When nothing can be evicted, the head waits for work already running (evictions,
reservations, claims: none of it waits on the head), claims above the high watermark when
only pins hold the tier up, asks the policy's fallback victims, and finally raises
:class:`~kvtier.errors.CapacityError` (a pinned-full tier is an error, never a deadlock).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Collection, Sequence

from kvtier.errors import CapacityError
from kvtier.keys import PageKey
from kvtier.plan.planner import Spare
from kvtier.transfer.evict import WAIT_RECHECK_S, Evictor
from kvtier.transfer.gate import Priority
from kvtier.transfer.mover import Mover
from kvtier.transfer.tier import Tier


class Room:
    """First-come first-served room claims on the tiers of ``mover``.

    Args:
        mover: the shared transfer state.
        evictor: the evict queues victims go to.
        background: grant claims that fit in capacity without waiting for the write-downs
            of their victims (the background evictor).
    """

    def __init__(self, mover: Mover, evictor: Evictor, *, background: bool) -> None:
        self.mover = mover
        self.evictor = evictor
        self.background = background
        self._queues: list[deque[asyncio.Future[None] | None]] = [deque() for _ in mover.tiers]

    def waiting(self, tier: Tier) -> int:
        """Callers queued for room in ``tier`` (the head included)."""
        return len(self._queues[tier.index])

    async def claim(
        self,
        tier: Tier,
        n: int,
        priority: Priority = Priority.EVICT,
        protect: Collection[PageKey] = (),
    ) -> bool:
        """Claim room for ``n`` pages in ``tier``, evicting per the watermarks first, but
        never one of ``protect`` (what the calling fetch brings up in other batches).

        On ``True`` the caller holds a claim of ``n`` pages (``tier.claimed``) that it must
        give back (by reserving, or by subtracting it). ``False`` means room could not be
        made because pages that should have gone down could not be written there (a lower
        tier is failing), or the only candidates stayed twice (pinned or kept by the
        policy each time): the caller treats its pages as failed.

        Raises:
            CapacityError: the tier is too small for ``n`` pages, or what fills it is
                pinned.
        """
        return await self._queued(tier, lambda: n, priority, protect) is not None

    async def claim_missing(
        self,
        tier: Tier,
        keys: Sequence[PageKey],
        priority: Priority = Priority.EVICT,
        protect: Collection[PageKey] = (),
    ) -> int | None:
        """Like :meth:`claim`, for the pages of ``keys`` that ``tier`` does not hold (in
        any state) when the claim is served: a batch racing this one (a prefetch and a
        load of the same pages) may bring some up meanwhile, and room for pages already
        there may not exist (they are pinned). Returns the pages claimed (0: none was
        needed), or ``None`` where :meth:`claim` returns ``False``."""
        d = self.mover.directory
        name = tier.name
        return await self._queued(
            tier, lambda: sum(1 for k in keys if d.state(k, name) is None), priority, protect
        )

    async def _queued(
        self,
        tier: Tier,
        need: Callable[[], int],
        priority: Priority,
        protect: Collection[PageKey],
    ) -> int | None:
        """Wait for the head of ``tier``'s queue, then claim ``need()`` pages there."""
        n = need()
        if n > tier.capacity_pages:
            raise CapacityError(
                f"tier {tier.name!r} holds {tier.capacity_pages} pages; a batch of {n} "
                f"pages cannot fit (lower pipeline.batch_pages or load fewer pages at once)"
            )
        queue = self._queues[tier.index]
        turn: asyncio.Future[None] | None = (
            asyncio.get_running_loop().create_future() if queue else None
        )
        queue.append(turn)
        try:
            if turn is not None:
                await turn
            return await self._make_room(tier, need, priority, protect)
        finally:
            queue.remove(turn)
            if queue and queue[0] is not None and not queue[0].done():
                queue[0].set_result(None)

    async def _make_room(
        self,
        tier: Tier,
        need: Callable[[], int],
        priority: Priority,
        protect: Collection[PageKey],
    ) -> int | None:
        """The head of ``tier``'s queue claims room for ``need()`` pages (asked again
        after every wait; see the module docstring). Returns the pages claimed, ``None``
        when room could not be made."""
        mover = self.mover
        planner = mover.planner
        d = mover.directory
        i = tier.index
        # victims that stay are not chosen again: those that could not leave (a failing
        # lower tier) at once, those a load pinned or the policy kept (a child landed
        # meanwhile) from their second time on (the first time, room-making goes on past
        # them, as the replay does)
        stuck: set[PageKey] = set()
        failed: set[PageKey] = set()
        kept: set[PageKey] = set()
        spare = Spare(protect, stuck)

        if tier.skips_write_downs(mover.next(tier)):
            planner.skip_write_downs(i, spare)

        async def evict(victims: list[PageKey]) -> None:
            out = await self.evictor.evict_reporting(tier, victims, priority)
            failed.update(out.failed)
            stuck.update(out.failed)
            if out.failed:  # the tier below refused: no other dirty page this call
                planner.skip_write_downs(i, spare)
            again = out.stay - out.failed
            stuck.update(again & kept)
            kept.update(again)

        while True:
            n = need()
            if n == 0:
                return 0
            if planner.fits(i, n, tier.claimed):
                tier.claimed += n
                return n
            used = d.used(tier.name) + tier.claimed
            victims = planner.room_victims(i, n, tier.claimed, spare)
            if victims:
                if self.background and used + n <= tier.capacity_pages:
                    self.evictor.submit(tier, victims, Priority.EVICT, spare=protect)
                    tier.claimed += n
                    return n
                await evict(victims)
                continue
            transient = d.evicting(tier.name) + tier.reserving + d.busy(tier.name) + tier.claimed
            if i == 0:  # stores wait for the pages write-throughs are checking (which
                transient += planner.checks_running  # never wait for the top tier)
            if transient:
                if used + n <= tier.capacity_pages and (
                    self.background or not self._drains_to_watermark(tier, n)
                ):
                    tier.claimed += n
                    return n
                await tier.wait_change(WAIT_RECHECK_S)
                continue
            if used + n <= tier.capacity_pages:
                tier.claimed += n  # above the high watermark: only pins/failures hold it
                return n
            # The policy's preferred victims ran out (e.g. leaf-first: only ancestors of
            # pinned pages are left); a policy may still name pages it would rather keep.
            victims = planner.fallback_victims(i, n, tier.claimed, spare)
            if victims:
                await evict(victims)
                continue
            if stuck or spare.skip is not None:  # a failing tier below holds the rest
                return None
            held = self.held(tier)
            why = (
                f"; none of the other {used - held} can go (its eviction policy "
                f"({tier.policy.name}) offers none, or this call is bringing them up)"
                if used > held
                else " and nothing else can be evicted"
            )
            advice = (
                "(release loaded pages with cache.release(keys); a transformers "
                "KVTierCache holds a working slot until closed: close the ones done with)"
                if held
                else "(nothing is pinned: the pages left are the earlier pages of sequences "
                "being stored, kept while their later pages stay (leaf-first), so this tier "
                "is smaller than the sequences stored into it at once: make it larger)"
            )
            raise CapacityError(
                f"tier {tier.name!r} cannot make room for {n} page(s): {held} of its "
                f"{tier.capacity_pages} pages are pinned or reserved{why} {advice}"
            )

    def _drains_to_watermark(self, tier: Tier, n: int) -> bool:
        """Whether waiting for in-progress work can bring ``tier`` under its high
        watermark (otherwise there is no point in waiting: only pins and reservations
        made outside the pipeline hold it up)."""
        return self.held(tier) + n <= max(tier.high_pages, n)

    def held(self, tier: Tier) -> int:
        """Pages of ``tier`` that no pipeline work will free: pinned pages and
        reservations taken outside the pipeline (e.g. an engine's working pool)."""
        d = self.mover.directory
        foreign = d.reserved(tier.name) - tier.reserving
        return d.pinned(tier.name) + max(0, foreign)
