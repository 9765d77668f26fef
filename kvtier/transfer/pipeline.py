"""The asyncio tier pipeline: the planner decides, the mover moves.

:class:`Pipeline` is what the facade drives. It puts together the
:class:`~kvtier.plan.planner.Planner` (every decision, synchronous, shared with the trace
replay) and the mover: :mod:`~kvtier.transfer.mover` (jobs, tasks, operations in flight),
:mod:`~kvtier.transfer.room` (first-come first-served room), :mod:`~kvtier.transfer.evict`
(the evict queue), :mod:`~kvtier.transfer.moves` (batches over
:mod:`~kvtier.transfer.links`), and the operations :mod:`~kvtier.transfer.fetch`,
:mod:`~kvtier.transfer.prefetch` and :mod:`~kvtier.transfer.store`.

Three kinds of work share each link, served in priority order by the link's gate:
demand fetches (``load``), prefetches (with a deadline), then evictions and write-downs.
Work is cut into batches of at most ``batch_pages`` pages; one batch is one backend call
per step (reserve, copy, commit), so one executor hop per batch, never per page. At most
``max_inflight_per_link`` batches run on a link at once.

Guarantees (design invariants 1, 2, 7, 8):

* **Two-phase visibility.** A page becomes visible in a tier only after its bytes were
  written and the backend committed it; a batch interrupted or failed is aborted, never
  half-visible.
* **Pins.** A pinned page, or one being copied, is never evicted or overwritten. When a
  tier cannot make room because what fills it is pinned, :class:`CapacityError` is
  raised (never a deadlock): room-making waits only for work that is already running
  (copies, evictions, reservations), and that work never waits on it.
* **Watermarks.** Before a batch takes room in a tier, the planner names victims so that
  the tier stays at or below its high watermark once the batch lands (down to the low
  watermark when it crosses it). With the background evictor (``background_eviction``,
  on by default) a batch that still fits in the tier's capacity does not wait for those
  victims: the evict queue writes them down while the batch lands, and the tier is back
  at or below its high watermark once the queue has run (:meth:`Pipeline.drain`). Only
  pinned pages can hold a tier above its high watermark after that.
* **Fair room.** Callers waiting for room in a tier are served first come, first served.
* **Eviction goes down.** A page evicted from tier *i* is first copied to tier *i + 1*,
  unless a lower tier already holds it or the write policy says to drop it; the last tier
  drops. A page whose write-down fails stays where it is (nothing committed is lost), and
  so does one the backend fails to delete (the index never forgets a page still held).
* **Failing tiers degrade to misses.** A backend that raises or reports failure makes
  those pages misses (or ``False`` results); the outage is logged once, not per page.
* **Cancellation.** Cancelling a caller (``load``, ``prefetch``, ``store``) cancels the
  batches that have not started; batches already running finish (and commit), so partial
  progress is kept and nothing is left half-done.

All metadata (directory, policies, tier counts) is touched only on the event-loop thread;
backends do blocking work on their executors.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Collection, Sequence

import numpy as np

from kvtier.backend import ArenaBackend, Reservation
from kvtier.errors import CapacityError, KVTierUsageError, TierIOError
from kvtier.health import LogEvery
from kvtier.index.directory import Directory
from kvtier.keys import PageKey
from kvtier.log import get_logger
from kvtier.metrics import CacheMetrics
from kvtier.plan.planner import Planner, PlanTier
from kvtier.policy.base import AdmissionPolicy
from kvtier.policy.write import WritePolicy
from kvtier.transfer import adopt
from kvtier.transfer.batch import abort_quietly, forget
from kvtier.transfer.evict import WAIT_RECHECK_S, Evictor
from kvtier.transfer.fetch import Fetcher
from kvtier.transfer.gate import Priority
from kvtier.transfer.links import Link
from kvtier.transfer.mover import Mover
from kvtier.transfer.moves import Moves
from kvtier.transfer.prefetch import Prefetcher
from kvtier.transfer.results import LoadResult, PrefetchResult
from kvtier.transfer.room import Room
from kvtier.transfer.store import Writer
from kvtier.transfer.tier import Tier, backend_failure

_log = get_logger("kvtier.pipeline")

__all__ = ["LoadResult", "Pipeline", "PrefetchResult"]


class Pipeline:
    """Moves pages between ``tiers`` (top first), keeping ``directory`` true.

    Args:
        tiers: opened tiers, top first.
        directory: the page index (its tier names are the tiers' names).
        metrics: where counters and histograms go.
        write_policy: ``write-through``, ``write-back`` or ``selective``.
        admission: admission policy consulted by ``selective``.
        batch_pages: maximum pages per batch.
        max_inflight_per_link: batches in flight per link.
        background_eviction: grant room that fits in a tier's capacity without waiting
            for the write-down of its victims, and trim tiers in the background.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        directory: Directory,
        metrics: CacheMetrics,
        *,
        write_policy: WritePolicy | str,
        admission: AdmissionPolicy,
        batch_pages: int,
        max_inflight_per_link: int,
        background_eviction: bool = True,
    ) -> None:
        self.tiers = list(tiers)
        self.directory = directory
        self.metrics = metrics
        #: one "delete could not remove" line a minute per set of failing tiers
        self._deletes_kept = LogEvery(60.0)
        self.planner = Planner(
            [PlanTier(t.name, t.limits, t.policy) for t in self.tiers],
            directory,
            write_policy,
            admission,
            batch_pages,
            held=lambda i: self.room.held(self.tiers[i]),
        )
        self.batch_pages = batch_pages
        self.max_inflight = max_inflight_per_link
        self.background_eviction = background_eviction
        self.mover = Mover(self.tiers, directory, metrics, self.planner, max_inflight_per_link)
        moves: Moves | None = None

        async def write_down(
            src: Tier, dst: Tier, keys: list[PageKey], prio: Priority
        ) -> list[bool]:
            assert moves is not None
            return await moves.write_down(src, dst, keys, prio)

        self.evictor = Evictor(
            self.mover,
            write_down,
            background=background_eviction,
            max_workers=max_inflight_per_link,
        )
        self.room = Room(self.mover, self.evictor, background=background_eviction)
        self._private: dict[PageKey, int] = {}  # private slots handed out: key -> handle
        moves = Moves(self.mover, self.room, self.evictor)
        self.moves = moves
        self._fetcher = Fetcher(self.mover, moves)
        self._prefetcher = Prefetcher(self.mover, moves)
        self._writer = Writer(self.mover, moves, self.drop)

    # -- what the pipeline is made of -------------------------------------------------------

    @property
    def top(self) -> Tier:
        return self.tiers[0]

    @property
    def write_policy(self) -> WritePolicy:
        return self.planner.write_policy

    @property
    def admission(self) -> AdmissionPolicy:
        return self.planner.admission

    def link(self, src: Tier, dst: Tier) -> Link:
        """The link from ``src`` to ``dst`` (created on first use)."""
        return self.mover.link(src, dst)

    @property
    def links(self) -> list[Link]:
        return self.mover.links

    @property
    def pending_tasks(self) -> int:
        """Jobs and background tasks not finished yet (what :meth:`drain` waits for)."""
        return self.mover.pending

    def tier(self, name: str) -> Tier:
        """The tier called ``name``; :class:`KVTierUsageError` naming the known ones."""
        for t in self.tiers:
            if t.name == name:
                return t
        known = ", ".join(t.name for t in self.tiers)
        raise KVTierUsageError(f"no tier named {name!r}; tiers: {known}")

    # -- the operations the facade exposes ----------------------------------------------------

    async def store(
        self,
        keys: Sequence[PageKey],
        bufs: Sequence[np.ndarray],
        parents: Sequence[PageKey | None],
        namespace: str,
    ) -> list[bool]:
        """Commit pages to the top tier (see :meth:`~kvtier.transfer.store.Writer.store`)."""
        return await self._writer.store(keys, bufs, parents, namespace)

    async def load(self, keys: Sequence[PageKey], pin: bool = True) -> LoadResult:
        """Bring ``keys`` to the top tier (see :meth:`~kvtier.transfer.fetch.Fetcher.load`)."""
        return await self._fetcher.load(keys, pin)

    async def read(self, keys: Sequence[PageKey], out: Sequence[np.ndarray]) -> list[bool]:
        """Copy pages out (see :meth:`~kvtier.transfer.fetch.Fetcher.read`)."""
        return await self._fetcher.read(keys, out)

    async def prefetch(self, keys: Sequence[PageKey], deadline_s: float) -> PrefetchResult:
        """Prefetch ``keys`` (see :meth:`~kvtier.transfer.prefetch.Prefetcher.prefetch`)."""
        return await self._prefetcher.prefetch(keys, deadline_s)

    async def make_room(
        self,
        tier: Tier,
        n: int,
        priority: Priority = Priority.EVICT,
        protect: Collection[PageKey] = (),
    ) -> bool:
        """Claim room for ``n`` pages in ``tier`` (see :meth:`~kvtier.transfer.room.Room.claim`)."""
        return await self.room.claim(tier, n, priority, protect)

    def release(self, keys: Sequence[PageKey]) -> None:
        """Drop one pin per key occurrence. Raises :class:`KVTierUsageError`, releasing
        nothing, when a key occurs more often than it is pinned.

        Starts no work: when pins held the top tier above its high watermark, the next
        operation that needs room there evicts it back down to the low watermark.
        """
        d = self.directory
        for k, n in Counter(keys).items():  # all checked first: an error changes nothing
            entry = d.get(k)
            held = entry.pins if entry is not None else 0
            if held < n:
                what = "is not pinned" if not held else f"holds {held} pin(s), released {n} times"
                raise KVTierUsageError(f"page {bytes(k).hex()} {what} (released twice?)")
        for k in keys:
            d.unpin(k)
        self.mover.changed(*self.tiers)

    async def demote(self, tier: Tier, keys: Sequence[PageKey]) -> list[PageKey]:
        """Move ``keys`` out of ``tier`` now, as eviction would: each is written to the tier
        below unless a lower tier holds it already or the write policy drops it (the last
        tier drops). Keys ``tier`` does not hold are ignored. Returns the pages that stay
        (their write-down failed, or the backend failed to delete them).

        Raises :class:`KVTierUsageError` (before moving anything) for a pinned key.
        """
        d = self.directory
        uniq = list(dict.fromkeys(keys))
        for k in uniq:
            if d.is_pinned(k):
                raise KVTierUsageError(f"page {bytes(k).hex()} is pinned: release it first")
        await self._quiesce(uniq, tier)
        here = [k for k in uniq if d.evictable(k, tier.name)]
        if not here:
            return []
        return sorted(await self.evictor.evict(tier, here, Priority.EVICT), key=uniq.index)

    async def delete(self, keys: Sequence[PageKey]) -> int:
        """Remove ``keys`` from every tier; returns how many copies were removed (a page
        held by two tiers counts twice). Copies of them under way (a prefetch) land first
        and are removed too: once this returns no tier holds them (unless a load pinned
        one meanwhile).

        Raises :class:`KVTierUsageError` (before changing anything) for a pinned key.
        """
        d = self.directory
        uniq = list(dict.fromkeys(keys))
        for k in uniq:
            if d.is_pinned(k):
                raise KVTierUsageError(f"page {bytes(k).hex()} is pinned: release it first")
        removed = 0
        left = uniq
        # pages a tier's backend failed to delete (an outage): not asked again this call,
        # so a frozen server costs one deadline, not one per pass
        stuck: dict[str, set[PageKey]] = {t.name: set() for t in self.tiers}
        for _ in range(2 * len(self.tiers) + 2):
            for tier in self.tiers:
                failed = stuck[tier.name]
                todo = [k for k in left if k not in failed]
                removed += len(await self.drop(tier, todo, None, failed))
            # a copy between tiers that began before this pass reached its source (a
            # prefetch, a fetch) lands in a tier the pass had left behind: go again
            left = [k for k in left if not d.is_pinned(k) and self._elsewhere(k, stuck)]
            if not left:
                break
        kept = {name: len(keys) for name, keys in stuck.items() if keys}
        if kept and (held := self._deletes_kept.due(",".join(kept))) is not None:
            _log.warning(
                "delete could not remove every page: a tier's backend failed to delete them, "
                "so they stay indexed and readable; delete them again once it is back",
                pages=kept,
                held_back=held,  # lines like this one not logged since the last
            )
        return removed

    def _elsewhere(self, key: PageKey, stuck: dict[str, set[PageKey]]) -> bool:
        """Whether a tier not in ``stuck`` for ``key`` holds it (in any state) or a copy
        of it is under way."""
        entry = self.directory.get(key)
        if self.mover.moving(key):
            return True
        return entry is not None and any(key not in stuck[t] for t in entry.states)

    async def drop(
        self,
        tier: Tier,
        keys: list[PageKey],
        still: Callable[[list[PageKey]], list[PageKey]] | None = None,
        stuck: set[PageKey] | None = None,
    ) -> list[PageKey]:
        """Remove the unpinned pages of ``keys`` (distinct) that ``tier`` holds from it,
        once work on them there has settled, without writing them down; returns those
        removed, and adds to ``stuck`` those the backend failed to delete. ``still``
        picks, in the same step as the removal begins, the pages that should still go
        (the reason to drop them may have gone while work settled)."""
        d = self.directory
        await self._quiesce(keys, tier)
        here = [k for k in keys if d.is_committed(k, tier.name) and not d.is_pinned(k)]
        if still is not None:
            here = still(here)
        if not here:
            return []
        fut = self.mover.op_future()
        for k in here:
            d.begin_evict(k, tier.name)
            self.mover.begin_op(k, tier, fut)
        tier.leaving.update(here)  # whatever pins them from now on
        # its own task: a cancelled caller cannot leave the index and the backend apart
        lingering = await asyncio.shield(self.mover.spawn(self._remove(tier, here)))
        if stuck is not None:
            stuck.update(lingering)
        return [k for k in here if k not in lingering]

    async def _quiesce(self, keys: list[PageKey], tier: Tier) -> None:
        """Wait until no operation or copy of ``keys`` is under way in ``tier``."""
        d = self.directory
        while True:
            await self.mover.settle(keys, [tier])
            if not any((e := d.get(k)) is not None and e.inflight.get(tier.name) for k in keys):
                return
            await tier.wait_change(WAIT_RECHECK_S)

    async def _remove(self, tier: Tier, keys: list[PageKey]) -> set[PageKey]:
        """Delete ``keys`` (marked ``evicting`` by the caller) from ``tier``; returns those
        the backend still holds."""
        try:
            return await forget(self.mover, tier, keys)
        finally:
            tier.leaving.difference_update(keys)
            self.evictor.release(tier, keys)

    # -- pages the pipeline did not put there ---------------------------------------------------

    async def recover(self) -> int:
        """Index the pages persistent stores already hold (see
        :func:`~kvtier.transfer.adopt.recover`)."""
        return await adopt.recover(self.mover)

    async def index_shared(self, keys: Sequence[PageKey], parent: PageKey, namespace: str) -> int:
        """Index what shared tiers hold of ``keys`` (see
        :func:`~kvtier.transfer.adopt.index_shared`)."""
        return await adopt.index_shared(self.mover, keys, parent, namespace)

    # -- private slots of the top tier ----------------------------------------------------------

    async def reserve_private(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation]:
        """Reserve one top-tier slot per key, never to be committed (see
        :meth:`kvtier.cache.KVCache.reserve_private`)."""
        top = self.top
        d = self.directory
        if not isinstance(top.backend, ArenaBackend):
            raise KVTierUsageError(
                f"private slots need an arena top tier; {top.name!r} is a {top.backend.kind}"
            )
        if len(set(keys)) != len(keys) or any(d.get(k) is not None for k in keys):
            raise KVTierUsageError("private slot keys must be distinct and not yet known")
        if not keys:
            return []
        if not await self.room.claim(top, len(keys), Priority.FETCH):
            raise CapacityError(f"tier {top.name!r}: no room for {len(keys)} private slots")
        for k in keys:
            d.reserve(k, top.name, namespace)
        top.claimed -= len(keys)  # the claim became directory reservations
        try:
            res = await top.backend.reserve(keys, namespace)
        except BaseException as exc:
            for k in keys:
                d.abort(k, top.name)
            top.notify()
            if not backend_failure(exc):
                raise
            top.record_failure("reserve", len(keys), exc)
            raise TierIOError(
                f"tier {top.name!r}: reserving {len(keys)} private slots failed: {exc!r}"
            ) from exc
        got = [r for r in res if r is not None]
        if len(got) < len(keys):
            try:
                await abort_quietly(top, got)  # a failing abort is recorded, not raised
            finally:
                for k in keys:
                    d.abort(k, top.name)
                top.notify()
            raise CapacityError(
                f"tier {top.name!r} could give only {len(got)} of {len(keys)} private slots"
            )
        self._private.update((r.key, r.handle) for r in got)
        return got

    async def release_private(self, reservations: Sequence[Reservation]) -> None:
        """Give back slots taken by :meth:`reserve_private` (their bytes are dropped).
        Raises :class:`KVTierUsageError` (before giving anything back) for anything that
        is not a private slot of this cache still held: another reservation given back
        here would free a slot a batch in flight is writing."""
        if isinstance(reservations, str | bytes) or not hasattr(reservations, "__iter__"):
            raise KVTierUsageError(
                "release_private needs the list reserve_private returned, got "
                f"{type(reservations).__name__}"
            )
        given = list(reservations)
        for i, r in enumerate(given):
            if not isinstance(r, Reservation) or self._private.get(r.key) != r.handle:
                raise KVTierUsageError(
                    f"reservations[{i}] is not a private slot this cache holds (only what "
                    f"reserve_private returned, once): {r!r:.80}"
                )
        if len({r.key for r in given}) != len(given):
            raise KVTierUsageError("release_private: a slot is given twice")
        top = self.top
        for r in given:  # taken out first: a concurrent release of the same slots refuses
            del self._private[r.key]
        try:
            await top.backend.abort(given)
        except BaseException:
            # nothing is known to be given back (a backend's abort is idempotent): the
            # slots stay private, so the caller can release them again
            for r in given:
                self._private[r.key] = r.handle
            raise
        for r in given:
            if self.directory.get(r.key) is not None:
                self.directory.abort(r.key, top.name)
        top.notify()

    # -- background work and shutdown -----------------------------------------------------------

    async def drain(self) -> None:
        """Wait until every background task (write-through, evictions, late prefetches)
        is done. Cancelling the caller stops the wait only."""
        await self.mover.drain()

    async def cancel_all(self) -> None:
        """Cancel every task the pipeline runs, started batches included, and wait for
        their clean-up (reservations aborted, pages left where they were). For a close
        that was itself cancelled: nothing may keep running against closed backends."""
        await self.mover.cancel_all()

    async def flush(self) -> int:
        """Write dirty memory-tier pages down (see :meth:`~kvtier.transfer.store.Writer.flush`)."""
        return await self._writer.flush()

    async def close(self) -> None:
        """Cancel prefetch batches not yet started, finish the rest, then flush.

        Only prefetches are cut short: their caller counts a cancelled batch as missing,
        whereas a cancelled load, store or write-down batch would hand a
        ``CancelledError`` to a caller (or an eviction) that was never cancelled."""
        self.mover.cancel_unstarted(Priority.PREFETCH)
        await self.drain()
        await self.flush()
        await self.drain()  # what the flush set off (no new call can start now)
