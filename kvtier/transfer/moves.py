"""Moving batches: claim room, take a link slot, commit the batch, trim the tier.

:meth:`Moves.move` runs one batch from a source tier (or from the caller's buffers) into a
destination tier: it claims room first (:class:`~kvtier.transfer.room.Room`, first come
first served), then a slot on the link (by priority), then commits the batch
(:func:`~kvtier.transfer.batch.commit_batch`). A page another batch was putting in the
same tier at the same time is not written twice (nor is room claimed for it): its outcome
is awaited instead. If the tier ends above its high watermark, the evict queue trims it,
sparing the pages the calling operation brings up. :meth:`Moves.copy` cuts a list of
pages into batches and runs each as its own job.
"""

from __future__ import annotations

from collections.abc import Collection, Coroutine, Sequence
from typing import Any

import numpy as np

from kvtier.keys import PageKey
from kvtier.transfer.batch import commit_batch
from kvtier.transfer.evict import Evictor
from kvtier.transfer.gate import Priority
from kvtier.transfer.mover import Job, Mover
from kvtier.transfer.room import Room
from kvtier.transfer.tier import Tier


class Moves:
    """Batches between the tiers of ``mover``, with room from ``room`` and trims by
    ``evictor``."""

    def __init__(self, mover: Mover, room: Room, evictor: Evictor) -> None:
        self.mover = mover
        self.room = room
        self.evictor = evictor

    async def move(
        self,
        src: Tier | None,
        dst: Tier,
        keys: list[PageKey],
        priority: Priority,
        job: Job | None = None,
        data: Sequence[np.ndarray] | None = None,
        parents: Sequence[PageKey | None] | None = None,
        namespace: str = "",
        evicting: bool = False,
        protect: Collection[PageKey] = (),
    ) -> list[bool]:
        """Bring ``keys`` into ``dst`` from ``src`` (or from ``data`` when ``src`` is None).

        ``True`` where the page is committed in ``dst`` afterwards, also when another
        operation put it there at the same time (then its outcome is awaited). If ``dst``
        ends above its high watermark, it is trimmed, sparing ``protect`` (the pages a
        fetch is bringing up for its caller).
        """
        mover = self.mover
        spare = mover.planner.room_spare(dst.index, self._parents(keys, parents), protect)
        # room for the pages not in dst when the claim is served: another batch (a
        # prefetch racing a load of the same pages) may have brought some up meanwhile
        claim = await self.room.claim_missing(dst, keys, priority, spare)
        if claim is None:
            return [False] * len(keys)
        link = mover.link(src, dst) if src is not None else None
        try:
            if link is not None:
                await link.gate.acquire(priority)
            try:
                if job is not None:
                    job.started = True
                ok = await commit_batch(
                    mover, src, dst, keys, claim, data, parents, namespace, evicting, link
                )
            finally:
                claim = 0  # commit_batch converted or released the claim
                if link is not None:
                    link.gate.release()
            # A page another batch was reserving (or evicting) in dst was skipped: its
            # outcome is this page's outcome. Waited for here, with no link slot held.
            racing = [k for k, o in zip(keys, ok, strict=True) if not o]
            if racing:
                await mover.settle(racing, [dst])
                ok = [
                    o or mover.directory.is_committed(k, dst.name)
                    for k, o in zip(keys, ok, strict=True)
                ]
            return ok
        finally:
            dst.claimed -= claim
            if claim:
                dst.notify()
            if mover.directory.used(dst.name) > dst.high_pages:
                await self.evictor.trim(dst, priority, protect)

    def _parents(
        self, keys: Sequence[PageKey], parents: Sequence[PageKey | None] | None
    ) -> list[PageKey | None]:
        """The parent of each page of a batch: given (fresh pages) or as recorded."""
        if parents is not None:
            return list(parents)
        d = self.mover.directory
        return [e.parent if (e := d.get(k)) is not None else None for k in keys]

    def launch(
        self,
        src: Tier | None,
        dst: Tier,
        keys: list[PageKey],
        priority: Priority,
        *,
        data: Sequence[np.ndarray] | None = None,
        parents: Sequence[PageKey | None] | None = None,
        namespace: str = "",
        evicting: bool = False,
        protect: Collection[PageKey] = (),
    ) -> Job:
        """Run one :meth:`move` batch as a job."""

        def run(job: Job) -> Coroutine[Any, Any, list[bool]]:
            return self.move(
                src,
                dst,
                keys,
                priority,
                job=job,
                data=data,
                parents=parents,
                namespace=namespace,
                evicting=evicting,
                protect=protect,
            )

        return self.mover.launch(run, priority)

    async def copy(
        self,
        src: Tier,
        dst: Tier,
        keys: list[PageKey],
        priority: Priority,
        evicting: bool = False,
    ) -> list[bool]:
        """Copy ``keys`` from ``src`` to ``dst`` in batches; ``True`` where ``dst`` holds
        the page afterwards (also when it already did)."""
        mover = self.mover
        await mover.settle(keys, [dst])
        ok: dict[PageKey, bool] = {}
        jobs: list[tuple[list[PageKey], Job]] = []
        for batch in mover.planner.batches(dst.index, keys):
            job = self.launch(src, dst, batch, priority, evicting=evicting)
            jobs.append((batch, job))
        results = await mover.await_jobs([j for _, j in jobs])
        for (batch, _), res in zip(jobs, results, strict=True):
            for k, r in zip(batch, res, strict=True):
                ok[k] = r
        return [ok[k] for k in keys]

    async def write_down(
        self, src: Tier, dst: Tier, keys: list[PageKey], priority: Priority
    ) -> list[bool]:
        """Copy victims being evicted from ``src`` down to ``dst`` (see :meth:`copy`)."""
        return await self.copy(src, dst, keys, priority, evicting=True)
