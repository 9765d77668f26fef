"""Demand fetches: bring pages to the top tier now (``load``) or copy them out (``read``).

One demand fetch (:meth:`Fetcher.load`), step by step:

1. every requested key is pinned (attention will read it), then counted: a hit in the
   highest tier holding it, a miss in every tier above (the planner's
   :meth:`~kvtier.plan.planner.Planner.note_lookup`);
2. pages not in the top tier are grouped by the tier to read them from (the planner's
   :meth:`~kvtier.plan.planner.Planner.source`) and cut into batches; each batch runs as a
   job at fetch priority: claim room in the top tier (first come first served; victims go
   to the evict queue), a link slot, reserve, copy, commit;
3. a page that failed in one tier is tried in the next tier holding it; one being moved
   by someone else is waited for;
4. the top tier is trimmed back under its high watermark, sparing the fetched pages, and
   the caller gets each page's slot (or learns it is missing: recompute it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.aio import finish_even_if_cancelled, run_together
from kvtier.errors import CapacityError, KVTierUsageError
from kvtier.index.directory import Directory
from kvtier.keys import PageKey
from kvtier.transfer.batch import purge_vanished
from kvtier.transfer.gate import Priority
from kvtier.transfer.mover import Job, Mover
from kvtier.transfer.moves import Moves
from kvtier.transfer.results import LoadResult
from kvtier.transfer.tier import Tier, backend_failure


@dataclass
class _Claim:
    """Pages of one tier a read copies out (``items``: indexes into ``keys``), each
    marked with :meth:`Directory.begin_copy` (not evictable there) until :meth:`release`."""

    directory: Directory
    tier: Tier
    keys: Sequence[PageKey]
    items: list[int]
    released: bool = False

    def release(self) -> None:
        """End the pages' copies (once; later calls do nothing)."""
        if not self.released:
            self.released = True
            for i in self.items:
                self.directory.end_copy(self.keys[i], self.tier.name)


class Fetcher:
    """Demand fetches over ``mover`` with batches from ``moves``."""

    def __init__(self, mover: Mover, moves: Moves) -> None:
        self.mover = mover
        self.moves = moves

    def count_served(self, key: PageKey, tier: int | None) -> None:
        """Hits/misses per tier for one requested page, by what served it: a hit in
        ``tier`` (the tier its bytes came from, or the top tier a load found it in) and a
        miss in every tier above; a miss in every tier when ``tier`` is ``None`` (absent,
        or every copy failed or failed verification: a page found but not served is no
        hit)."""
        metrics = self.mover.metrics
        for t in self.mover.tiers:
            if t.index == tier:
                metrics.hits.inc(t.name)
                return
            metrics.misses.inc(t.name)

    async def load(self, keys: Sequence[PageKey], pin: bool = True) -> LoadResult:
        """Bring ``keys`` to the top tier in one batched pass; pins each (until release)
        when ``pin``. Raises :class:`CapacityError` when they cannot all fit."""
        if not isinstance(pin, bool | np.bool_):
            raise KVTierUsageError(f"pin must be True or False, got {pin!r:.40}")
        mover = self.mover
        planner = mover.planner
        top = mover.top
        d = mover.directory
        uniq = list(dict.fromkeys(keys))
        if len(uniq) > top.capacity_pages:
            raise CapacityError(
                f"cannot load {len(uniq)} distinct pages into tier {top.name!r}, which holds "
                f"{top.capacity_pages} pages"
            )
        started = time.perf_counter()
        for k in keys:
            d.pin(k)
        # pinned before the evictor decided: a page being evicted from the top tier stays
        # there (its write-down is not waited for)
        here = {k for k in uniq if top.stays(k, d)}
        wait = [k for k in uniq if k not in here]
        ok = False
        try:
            await mover.settle(wait, [top])
            # the policies see every reference now; the metrics count what served it
            found = {k: planner.note_lookup(k, top.index if k in here else None) for k in uniq}
            served = {k: top.index for k in uniq if k in here or d.is_committed(k, top.name)}
            failed: dict[PageKey, set[str]] = {k: set() for k in uniq}
            wanted = frozenset(uniq)
            for _round in range(2 * len(mover.tiers) + 2):
                await mover.settle(wait, [top])  # fetched or evicted by someone else
                need = [k for k in wait if not d.is_committed(k, top.name)]
                groups: dict[int, list[PageKey]] = {}
                moving: list[PageKey] = []
                for k in need:
                    src = planner.source(k, failed[k])
                    if src is not None:
                        groups.setdefault(src, []).append(k)
                    elif mover.moving(k):
                        moving.append(k)  # on its way between lower tiers: wait for it
                if not groups:
                    if not moving:
                        break
                    await mover.settle(moving)
                    continue
                jobs: list[tuple[list[PageKey], Tier, Job]] = []
                for idx, group in groups.items():
                    src_tier = mover.tiers[idx]
                    for batch in mover.planner.batches(top.index, group):
                        job = self.moves.launch(
                            src_tier, top, batch, Priority.FETCH, protect=wanted
                        )
                        jobs.append((batch, src_tier, job))
                results = await mover.await_jobs([j for _, _, j in jobs])
                for (batch, src_tier, _), res in zip(jobs, results, strict=True):
                    served.update((k, src_tier.index) for k, r in zip(batch, res, strict=True) if r)
                    bad = [k for k, r in zip(batch, res, strict=True) if not r]
                    for k in bad:
                        failed[k].add(src_tier.name)
                    if bad:
                        await purge_vanished(mover, src_tier, bad)
            if d.used(top.name) > top.high_pages:
                await self.moves.evictor.trim(top, Priority.FETCH, wanted)
            ok = True
        finally:
            if not pin or not ok:
                for k in keys:
                    d.unpin(k)
            mover.changed(*mover.tiers)
        mover.metrics.fetch_latency.observe(time.perf_counter() - started)
        slots: list[int | None] = []
        missing: list[PageKey] = []
        for k in keys:
            if d.is_committed(k, top.name) or (k in here and top.stays(k, d)):
                slots.append(top.arena.slot_of(k) if top.is_arena else None)
            else:
                slots.append(None)
                missing.append(k)
        gone = set(missing)
        for k in uniq:  # fetched by another call meanwhile: from where it was found
            self.count_served(k, None if k in gone else served.get(k, found[k]))
        return LoadResult(slots, missing)

    async def read(self, keys: Sequence[PageKey], out: Sequence[np.ndarray]) -> list[bool]:
        """Copy each page from the highest tier holding it into ``out[i]``; ``False`` for a
        miss (absent, or every tier holding it failed or failed verification). Pages in
        different tiers are read concurrently, one call per tier; a page that failed in one
        tier is tried in the next tier holding it."""
        mover = self.mover
        ok = [False] * len(keys)
        for k in dict.fromkeys(keys):
            mover.planner.note_lookup(k)
        served: dict[PageKey, int] = {}
        try:
            await self._read(keys, out, ok, served)
        finally:
            for k in dict.fromkeys(keys):
                self.count_served(k, served.get(k))
        return ok

    async def _read(
        self,
        keys: Sequence[PageKey],
        out: Sequence[np.ndarray],
        ok: list[bool],
        served: dict[PageKey, int],
    ) -> None:
        """:meth:`read`'s rounds: set ``ok`` and, for each page read, the tier it came
        from in ``served``."""
        mover = self.mover
        d = mover.directory
        tried: list[set[str]] = [set() for _ in keys]
        for _round in range(2 * len(mover.tiers) + 2):
            groups: dict[int, list[int]] = {}
            moving: list[PageKey] = []
            for i, k in enumerate(keys):
                if ok[i]:
                    continue
                for t in mover.tiers:
                    if t.name not in tried[i] and d.is_committed(k, t.name):
                        groups.setdefault(t.index, []).append(i)
                        break
                else:
                    if mover.moving(k):
                        moving.append(k)  # being evicted or written: wait, then look again
            if not groups:
                if not moving:
                    return
                await mover.settle(moving)
                continue
            # every group's pages are marked as being copied before any group is awaited
            # (none can be evicted meanwhile); the groups are then read concurrently, so
            # a read spanning two slow tiers (NVMe, a remote pool) waits for the slower
            # one, not for the sum
            claims = [
                self._claim(mover.tiers[idx], keys, groups[idx], tried) for idx in sorted(groups)
            ]
            claims = [c for c in claims if c.items]
            try:
                if len(claims) == 1:  # the usual case: no task, no extra loop turns
                    await self._copy_group(claims[0], out, ok)
                elif claims:
                    await run_together([self._copy_group(c, out, ok) for c in claims])
            finally:
                for c in claims:  # a copy cancelled before its task started never ran
                    c.release()
                    for i in c.items:
                        if ok[i]:
                            served.setdefault(keys[i], c.tier.index)

    def _claim(
        self, tier: Tier, keys: Sequence[PageKey], group: list[int], tried: list[set[str]]
    ) -> _Claim:
        """The pages of ``group`` (indexes into ``keys``) still committed in ``tier``,
        each marked as tried there and as being copied out (until the claim's release)."""
        claim = _Claim(self.mover.directory, tier, keys, [])
        for i in group:
            if claim.directory.is_committed(keys[i], tier.name):
                tried[i].add(tier.name)
                claim.directory.begin_copy(keys[i], tier.name)
                claim.items.append(i)
        return claim

    async def _copy_group(self, claim: _Claim, out: Sequence[np.ndarray], ok: list[bool]) -> None:
        """Read the claimed pages out of their tier in one call into ``out``, setting
        ``ok`` for each; releases the claim, however it ends."""
        mover = self.mover
        tier, keys, items = claim.tier, claim.keys, claim.items
        start = time.perf_counter()
        try:
            call = tier.backend.get([keys[i] for i in items], [out[i] for i in items])
            if tier.backend.get_finishes_before_raising:
                got = await call  # no task and shield: three loop turns less per read
            else:
                got = await finish_even_if_cancelled(call)
        except BaseException as exc:
            if not backend_failure(exc):
                raise
            tier.record_failure("get", len(items), exc)
            got = [False] * len(items)
        finally:
            claim.release()
        moved = sum(got)
        mover.metrics.record_transfer(
            f"{tier.name}->out", moved, moved * tier.backend.page_bytes, time.perf_counter() - start
        )
        bad = [keys[i] for i, g in zip(items, got, strict=True) if not g]
        for i, g in zip(items, got, strict=True):
            ok[i] = g
        if bad:
            mover.metrics.failed.inc(tier.name, by=len(bad))
            asked = await tier.record_all_missed("get", bad) if len(bad) == len(items) else None
            await purge_vanished(mover, tier, bad, asked)
        elif items:
            tier.record_success()
        mover.changed(tier)
