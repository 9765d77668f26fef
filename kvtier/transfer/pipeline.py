"""The asyncio tier pipeline: moves pages between tiers on demand, ahead of time and down.

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
* **Watermarks.** Before a batch takes room in a tier, pages are evicted so that the tier
  stays at or below its high watermark after the batch lands (down to the low watermark
  when it crosses it). Only pinned pages can hold a tier above its high watermark.
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
import math
import time
from collections import Counter
from collections.abc import Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from kvtier.backend import Reservation
from kvtier.errors import CapacityError, KVTierError, KVTierUsageError
from kvtier.index.directory import Directory, PageState
from kvtier.keys import PageKey
from kvtier.log import get_logger
from kvtier.metrics import CacheMetrics
from kvtier.policy.base import AdmissionPolicy
from kvtier.transfer.links import Link, Priority
from kvtier.transfer.tier import Tier

_log = get_logger("kvtier.pipeline")

T = TypeVar("T")

#: How long a room-making wait sleeps at most before re-checking (a safety net: every
#: change that frees room also wakes the waiters).
_WAIT_RECHECK_S = 0.05


@dataclass
class LoadResult:
    """Result of :meth:`Pipeline.load`.

    Attributes:
        slots: top-tier slot of each requested key (``None`` when missing, or when the top
            tier is a store).
        missing: keys that could not be brought to the top tier (absent everywhere, or
            every tier holding them failed): the engine recomputes them.
    """

    slots: list[int | None]
    missing: list[PageKey]


@dataclass
class PrefetchResult:
    """Result of :meth:`Pipeline.prefetch`.

    Attributes:
        arrived: keys resident in the top tier by the deadline.
        late: keys still moving at the deadline (they may land later, in the background).
        missing: keys absent from every tier, or whose transfer failed.
    """

    arrived: list[PageKey]
    late: list[PageKey] = field(default_factory=list)
    missing: list[PageKey] = field(default_factory=list)


class _Job:
    """One batch running as its own task at ``priority``; ``started`` once it holds room
    and a link slot, after which it is never cancelled (it finishes and commits or aborts
    cleanly)."""

    __slots__ = ("priority", "started", "task")

    def __init__(self, priority: Priority) -> None:
        self.priority = priority
        self.started = False
        self.task: asyncio.Task[Any] | None = None


def _chunks(items: Sequence[PageKey], n: int) -> list[list[PageKey]]:
    return [list(items[i : i + n]) for i in range(0, len(items), n)]


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
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        directory: Directory,
        metrics: CacheMetrics,
        *,
        write_policy: str,
        admission: AdmissionPolicy,
        batch_pages: int,
        max_inflight_per_link: int,
    ) -> None:
        self.tiers = list(tiers)
        self.directory = directory
        self.metrics = metrics
        self.write_policy = write_policy
        self.admission = admission
        self.batch_pages = batch_pages
        self.max_inflight = max_inflight_per_link
        self._links: dict[tuple[int, int], Link] = {}
        self._ops: dict[tuple[PageKey, str], asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._jobs: set[_Job] = set()

    # -- small helpers -------------------------------------------------------------------

    @property
    def top(self) -> Tier:
        return self.tiers[0]

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

    def _batch_size(self, dst: Tier) -> int:
        """Pages per batch into ``dst``: the configured size, but never more than the tier
        holds under its high watermark (so a batch can always be made room for)."""
        return max(1, min(self.batch_pages, dst.high_pages))

    def _next(self, tier: Tier) -> Tier | None:
        return self.tiers[tier.index + 1] if tier.index + 1 < len(self.tiers) else None

    def _changed(self, *tiers: Tier) -> None:
        for t in tiers:
            self.metrics.used.set(self.directory.used(t.name), t.name)
            t.notify()

    @staticmethod
    def _op_future() -> asyncio.Future[None]:
        """One future per batch, shared by its pages (resolved when the batch ends)."""
        return asyncio.get_running_loop().create_future()

    def _begin_op(self, key: PageKey, tier: Tier, fut: asyncio.Future[None]) -> None:
        op = (key, tier.name)
        if op in self._ops:  # pragma: no cover - guarded by the state checks
            raise AssertionError(f"two operations on page {key.hex()} in {tier.name}")
        self._ops[op] = fut

    def _end_op(self, key: PageKey, tier: Tier) -> None:
        fut = self._ops.pop((key, tier.name), None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def _settle(self, keys: Sequence[PageKey], tiers: Sequence[Tier] | None = None) -> None:
        """Wait until no reservation or eviction of ``keys`` is in progress in ``tiers``."""
        names = [t.name for t in (tiers if tiers is not None else self.tiers)]
        while True:
            pending = {self._ops[(k, n)] for k in keys for n in names if (k, n) in self._ops}
            if not pending:
                return
            await asyncio.wait(pending)  # never cancels the futures it waits on

    def _wants_down(self, key: PageKey) -> bool:
        """Whether the write policy sends ``key`` to a lower tier."""
        return self.write_policy != "selective" or self.admission.admit(key)

    def _launch(self, fn: Callable[[_Job], Coroutine[Any, Any, Any]], priority: Priority) -> _Job:
        job = _Job(priority)
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

    def _launch_move(
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
    ) -> _Job:
        """Run one :meth:`_move` batch as a job."""

        def run(job: _Job) -> Coroutine[Any, Any, list[bool]]:
            return self._move(
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

        return self._launch(run, priority)

    async def _await_jobs(self, jobs: Sequence[_Job]) -> list[Any]:
        """Results of ``jobs``; on cancellation, un-started jobs are cancelled and running
        ones finish in the background. Once every job has ended, the first exception one
        of them raised (a CapacityError, typically) is re-raised."""
        tasks = [j.task for j in jobs if j.task is not None]
        try:
            results = await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
        except asyncio.CancelledError:
            for j in jobs:
                if not j.started and j.task is not None:
                    j.task.cancel()
            raise
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return list(results)

    # -- room ----------------------------------------------------------------------------

    async def make_room(
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
        tier is failing): the caller treats its pages as failed. Write-downs it triggers
        run at the caller's ``priority`` (a demand fetch is not queued behind background
        write-through).

        Raises:
            CapacityError: the tier is too small for ``n`` pages, or what fills it is
                pinned.
        """
        if n > tier.capacity_pages:
            raise CapacityError(
                f"tier {tier.name!r} holds {tier.capacity_pages} pages; a batch of {n} "
                f"pages cannot fit (lower pipeline.batch_pages or load fewer pages at once)"
            )
        stuck: set[PageKey] = set()
        d = self.directory
        name = tier.name
        ok_limit = max(tier.high_pages, n)
        target = max(tier.low_pages, n)
        while True:
            used = d.used(name) + tier.claimed
            if used + n <= ok_limit:
                tier.claimed += n
                return True
            evicting = d.count(name, PageState.EVICTING)
            want = used + n - target - evicting

            def ok_victim(k: PageKey, skip: set[PageKey] = stuck) -> bool:
                return k not in skip and k not in protect and d.evictable(k, name)

            victims = tier.policy.victims(want, ok_victim) if want > 0 else []
            if victims:
                stuck.update(await self._evict_shielded(tier, victims, priority))
                continue
            transient = evicting + tier.reserving + d.busy(name) + tier.claimed
            if transient:
                if used + n <= tier.capacity_pages and not self._drains_to_watermark(tier, n):
                    tier.claimed += n
                    return True
                await tier.wait_change(_WAIT_RECHECK_S)
                continue
            if used + n <= tier.capacity_pages:
                tier.claimed += n  # above the high watermark: only pins/failures hold it
                return True
            # The policy's preferred victims ran out (e.g. leaf-first: only ancestors of
            # pinned pages are left); a policy may still name pages it would rather keep.
            victims = tier.policy.fallback_victims(want, ok_victim) if want > 0 else []
            if victims:
                stuck.update(await self._evict_shielded(tier, victims, priority))
                continue
            if stuck:
                return False
            held = self._held(tier)
            why = (
                f"; none of the other {used - held} can go (its eviction policy "
                f"({tier.policy.name}) offers none, or this call is bringing them up)"
                if used > held
                else " and nothing else can be evicted"
            )
            raise CapacityError(
                f"tier {name!r} cannot make room for {n} page(s): {held} of its "
                f"{tier.capacity_pages} pages are pinned or reserved{why} "
                f"(release loaded pages with cache.release(keys))"
            )

    def _drains_to_watermark(self, tier: Tier, n: int) -> bool:
        """Whether waiting for in-progress work can bring ``tier`` under its high
        watermark (otherwise there is no point in waiting: only pins and reservations
        made outside the pipeline hold it up)."""
        return self._held(tier) + n <= max(tier.high_pages, n)

    def _held(self, tier: Tier) -> int:
        """Pages of ``tier`` that no pipeline work will free: pinned pages and
        reservations taken outside the pipeline (e.g. an engine's working pool)."""
        d = self.directory
        foreign = d.count(tier.name, PageState.RESERVED) - tier.reserving
        return d.pinned(tier.name) + max(0, foreign)

    async def _evict_shielded(
        self, tier: Tier, victims: list[PageKey], priority: Priority = Priority.EVICT
    ) -> set[PageKey]:
        """Run an eviction as its own task so a cancelled caller cannot cut it short.

        The victims are marked ``evicting`` before this returns to the loop, so nothing
        can start copying them meanwhile."""
        d = self.directory
        fut = self._op_future()
        for k in victims:
            d.begin_evict(k, tier.name)
            self._begin_op(k, tier, fut)
        return await asyncio.shield(self._spawn(self._evict(tier, victims, priority)))

    async def _evict(
        self, tier: Tier, victims: list[PageKey], priority: Priority = Priority.EVICT
    ) -> set[PageKey]:
        """Evict ``victims`` from ``tier`` (writing them down first where needed).

        The victims must already be marked ``evicting`` (see :meth:`_evict_shielded`).
        Returns the victims that stay because their write-down failed, or because the
        backend failed to delete them.
        """
        d = self.directory
        stuck: set[PageKey] = set()
        try:
            nxt = self._next(tier)
            down: list[PageKey] = []
            dropping: set[PageKey] = set()
            for k in victims:
                if d.below(k, tier.name):
                    continue
                if nxt is not None and self._wants_down(k):
                    down.append(k)
                else:
                    dropping.add(k)
            if down and nxt is not None:
                try:
                    ok = await self._copy(tier, nxt, down, priority, evicting=True)
                except CapacityError as exc:
                    _log.warning("write-down blocked", tier=nxt.name, reason=str(exc))
                    ok = [False] * len(down)
                stuck = {k for k, o in zip(down, ok, strict=True) if not o}
            keep = [k for k in victims if k in stuck or d.is_pinned(k)]
            go = [k for k in victims if k not in keep]
            for k in keep:
                d.cancel_evict(k, tier.name)
            if go:
                lingering = await self._forget(tier, go)
                stuck |= lingering
                go = [k for k in go if k not in lingering]
            if go:
                self.metrics.evicted.inc(tier.name, by=len(go))
                dropped = sum(1 for k in go if k in dropping)
                if dropped:
                    self.metrics.dropped.inc(tier.name, by=dropped)
            return stuck
        finally:
            for k in victims:
                if d.state(k, tier.name) is PageState.EVICTING:  # an exception cut us short
                    d.cancel_evict(k, tier.name)
                self._end_op(k, tier)
            self._changed(tier)

    # -- moving a batch ------------------------------------------------------------------

    async def _move(
        self,
        src: Tier | None,
        dst: Tier,
        keys: list[PageKey],
        priority: Priority,
        job: _Job | None = None,
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
        n = len(keys)
        if not await self.make_room(dst, n, priority, protect):
            return [False] * n
        claim = n
        link = self.link(src, dst) if src is not None else None
        try:
            if link is not None:
                await link.gate.acquire(priority)
            try:
                if job is not None:
                    job.started = True
                ok = await self._move_locked(
                    src, dst, keys, claim, data, parents, namespace, evicting, link
                )
            finally:
                claim = 0  # _move_locked converted or released the claim
                if link is not None:
                    link.gate.release()
            # A page another batch was reserving (or evicting) in dst was skipped: its
            # outcome is this page's outcome. Waited for here, with no link slot held.
            racing = [k for k, o in zip(keys, ok, strict=True) if not o]
            if racing:
                await self._settle(racing, [dst])
                ok = [
                    o or self.directory.is_committed(k, dst.name)
                    for k, o in zip(keys, ok, strict=True)
                ]
            return ok
        finally:
            dst.claimed -= claim
            if claim:
                dst.notify()
            if self.directory.used(dst.name) > dst.high_pages:
                await self._trim(dst, priority, protect)

    async def _reserve_by_namespace(
        self, dst: Tier, keys: list[PageKey], namespace: str
    ) -> list[Reservation | None]:
        """Reserve ``keys`` in ``dst``, each under its own namespace label: ``namespace``
        when given (fresh pages), else the one the directory recorded when the page was
        first stored (pages moving between tiers), so stores label every page. When a
        later group's call raises, the earlier groups' reservations are aborted first."""
        if namespace:
            return await dst.backend.reserve(keys, namespace)
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            entry = self.directory.get(k)
            groups.setdefault(entry.namespace if entry is not None else "", []).append(i)
        out: list[Reservation | None] = [None] * len(keys)
        try:
            for label, idx in groups.items():
                got = await dst.backend.reserve([keys[i] for i in idx], label)
                for i, r in zip(idx, got, strict=True):
                    out[i] = r
        except BaseException:
            taken = [r for r in out if r is not None]
            if taken:
                await self._abort_quietly(dst, taken)
            raise
        return out

    async def _trim(
        self, tier: Tier, priority: Priority, protect: Collection[PageKey] = ()
    ) -> None:
        """Bring ``tier`` back under its high watermark after batches landed above it.

        Room is claimed before batches land, but concurrent batches can each find the
        tier held up by pins, claim room above the watermark, and land; once they have,
        their pages are evictable, so they are evicted (down to the low watermark).
        Pages in ``protect`` are spared: a fetch does not evict what it brought up.
        """
        d = self.directory
        while True:
            used = d.used(tier.name)
            if used <= tier.high_pages:
                return
            want = used - tier.low_pages - d.count(tier.name, PageState.EVICTING)
            if want <= 0:
                return

            def ok_victim(k: PageKey) -> bool:
                return k not in protect and d.evictable(k, tier.name)

            victims = tier.policy.victims(want, ok_victim)
            if not victims:
                return
            stuck = await self._evict_shielded(tier, victims, priority)
            if len(stuck) == len(victims):
                return

    async def _move_locked(
        self,
        src: Tier | None,
        dst: Tier,
        keys: list[PageKey],
        claim: int,
        data: Sequence[np.ndarray] | None,
        parents: Sequence[PageKey | None] | None,
        namespace: str,
        evicting: bool,
        link: Link | None,
    ) -> list[bool]:
        d = self.directory
        src_states = (
            (PageState.COMMITTED, PageState.EVICTING) if evicting else (PageState.COMMITTED,)
        )
        ok = [False] * len(keys)
        todo: list[int] = []
        for i, k in enumerate(keys):
            state = d.state(k, dst.name)
            if state is not None:
                ok[i] = state is PageState.COMMITTED
            elif src is not None and d.state(k, src.name) not in src_states:
                pass
            else:
                todo.append(i)
        fut = self._op_future()
        for i in todo:
            k = keys[i]
            d.reserve(k, dst.name, namespace, parents[i] if parents is not None else None)
            dst.reserving += 1
            self._begin_op(k, dst, fut)
            if src is not None:
                d.begin_copy(k, src.name)
        dst.claimed -= claim  # the claim became reservations (or is not needed)
        open_res: dict[int, Reservation] = {}
        reserved_dir = set(todo)
        try:
            if not todo:
                return ok
            tkeys = [keys[i] for i in todo]
            try:
                res = await self._reserve_by_namespace(dst, tkeys, namespace)
            except KVTierUsageError:
                raise
            except Exception as exc:
                dst.record_failure("reserve", len(todo), exc)
                res = [None] * len(todo)
            got: list[tuple[int, Reservation]] = []
            for i, r in zip(todo, res, strict=True):
                if r is None:
                    d.abort(keys[i], dst.name)
                    reserved_dir.discard(i)
                else:
                    got.append((i, r))
                    open_res[i] = r
            if not got:
                return ok
            if link is not None:
                written = await link.transfer([keys[i] for i, _ in got], [r for _, r in got])
            else:
                assert data is not None
                written = await self._write_user(
                    dst, [r for _, r in got], [data[i] for i, _ in got]
                )
            failed = [r for (_, r), w in zip(got, written, strict=True) if not w]
            if failed:
                await self._abort_quietly(dst, failed)
                for (i, _), w in zip(got, written, strict=True):
                    if not w:
                        open_res.pop(i, None)
            to_commit = [(i, r) for (i, r), w in zip(got, written, strict=True) if w]
            committed: list[bool] = [False] * len(to_commit)
            if to_commit:
                try:
                    committed = await dst.backend.commit([r for _, r in to_commit])
                except KVTierUsageError:
                    raise
                except Exception as exc:
                    dst.record_failure("commit", len(to_commit), exc)
                    await self._abort_quietly(dst, [r for _, r in to_commit])
            for (i, _), c in zip(to_commit, committed, strict=True):
                open_res.pop(i, None)
                k = keys[i]
                reserved_dir.discard(i)
                if c:
                    d.commit(k, dst.name)
                    dst.policy.on_insert(k, parents[i] if parents is not None else None)
                    ok[i] = True
                else:
                    d.abort(k, dst.name)
            for i, _ in got:
                if not ok[i] and i in reserved_dir:
                    d.abort(keys[i], dst.name)
                    reserved_dir.discard(i)
            stored = sum(1 for i in todo if ok[i])
            if stored:
                self.metrics.stored.inc(dst.name, by=stored)
                dst.record_success()
            if len(todo) - stored:
                self.metrics.failed.inc(dst.name, by=len(todo) - stored)
            return ok
        finally:
            if open_res:  # an exception cut the batch short: nothing half-visible
                await self._abort_quietly(dst, list(open_res.values()))
            for i in reserved_dir:
                if d.state(keys[i], dst.name) is PageState.RESERVED:
                    d.abort(keys[i], dst.name)
            dst.reserving -= len(todo)
            for i in todo:
                if src is not None:
                    d.end_copy(keys[i], src.name)
                self._end_op(keys[i], dst)
            self._changed(dst, *([src] if src is not None else []))

    async def _write_user(
        self, dst: Tier, reservations: list[Reservation], bufs: list[np.ndarray]
    ) -> list[bool]:
        start = time.perf_counter()
        try:
            written = await dst.backend.write(reservations, bufs)
        except KVTierUsageError:
            raise
        except Exception as exc:
            dst.record_failure("write", len(reservations), exc)
            return [False] * len(reservations)
        moved = sum(written)
        self.metrics.record_transfer(
            f"in->{dst.name}", moved, moved * dst.backend.page_bytes, time.perf_counter() - start
        )
        return list(written)

    @staticmethod
    async def _abort_quietly(tier: Tier, reservations: list[Reservation]) -> None:
        try:
            await tier.backend.abort(reservations)
        except Exception as exc:
            tier.record_failure("abort", len(reservations), exc)

    async def _copy(
        self,
        src: Tier,
        dst: Tier,
        keys: list[PageKey],
        priority: Priority,
        evicting: bool = False,
    ) -> list[bool]:
        """Copy ``keys`` from ``src`` to ``dst`` in batches; ``True`` where ``dst`` holds
        the page afterwards (also when it already did)."""
        await self._settle(keys, [dst])
        ok: dict[PageKey, bool] = {}
        jobs: list[tuple[list[PageKey], _Job]] = []
        for batch in _chunks(keys, self._batch_size(dst)):
            job = self._launch_move(src, dst, batch, priority, evicting=evicting)
            jobs.append((batch, job))
        results = await self._await_jobs([j for _, j in jobs])
        for (batch, _), res in zip(jobs, results, strict=True):
            for k, r in zip(batch, res, strict=True):
                ok[k] = r
        return [ok[k] for k in keys]

    # -- the operations the facade exposes ----------------------------------------------

    async def store(
        self,
        keys: Sequence[PageKey],
        bufs: Sequence[np.ndarray],
        parents: Sequence[PageKey | None],
        namespace: str,
    ) -> list[bool]:
        """Commit pages to the top tier (buffers already validated); write-through/
        selective policies then copy them down in the background."""
        top = self.top
        d = self.directory
        n = len(keys)
        out = [False] * n
        await self._settle(keys, [top])
        first: dict[PageKey, int] = {}
        todo: list[int] = []
        for i, k in enumerate(keys):
            if k in first:
                continue
            first[k] = i
            self.admission.on_access(k)
            self.admission.note_parent(k, parents[i])
            if d.state(k, top.name) is PageState.COMMITTED:
                top.policy.on_access(k)
                out[i] = True
            else:
                todo.append(i)
        jobs: list[tuple[list[int], _Job]] = []
        size = self._batch_size(top)
        for start in range(0, len(todo), size):
            idx = todo[start : start + size]
            bkeys = [keys[i] for i in idx]
            bdata = [bufs[i] for i in idx]
            bpar = [parents[i] for i in idx]
            job = self._launch_move(
                None, top, bkeys, Priority.FETCH, data=bdata, parents=bpar, namespace=namespace
            )
            jobs.append((idx, job))
        results = await self._await_jobs([j for _, j in jobs])
        for (idx, _), res in zip(jobs, results, strict=True):
            for i, r in zip(idx, res, strict=True):
                out[i] = r
        for i, k in enumerate(keys):
            out[i] = out[first[k]]
        if d.used(top.name) > top.high_pages:
            await self._trim(top, Priority.FETCH)
        stored = [keys[i] for i in todo if out[i]]
        if stored and self.write_policy != "write-back" and len(self.tiers) > 1:
            self._spawn(self._write_through(top, stored))
        return out

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` as a background task that :meth:`drain` (and so close) awaits."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _write_through(self, src: Tier, keys: list[PageKey]) -> None:
        """Copy freshly committed pages down the hierarchy (background)."""
        dst = self._next(src)
        if dst is None or not keys:
            return
        d = self.directory
        keys = [k for k in keys if self._wants_down(k)]
        await self._settle(keys, [dst])
        keys = [k for k in keys if d.state(k, dst.name) is None and d.is_committed(k, src.name)]
        if not keys:
            return
        try:
            ok = await self._copy(src, dst, keys, Priority.EVICT)
        except CapacityError as exc:
            _log.warning("write-through blocked: pages stay dirty", tier=dst.name, reason=str(exc))
            return
        landed = [k for k, o in zip(keys, ok, strict=True) if o]
        if landed:
            await self._write_through(dst, landed)

    def _source(self, key: PageKey, exclude: set[str]) -> Tier | None:
        """The highest tier below the top where ``key`` is committed, skipping ``exclude``."""
        for t in self.tiers[1:]:
            if t.name not in exclude and self.directory.is_committed(key, t.name):
                return t
        return None

    def _count_lookup(self, key: PageKey) -> None:
        """Hits/misses per tier for one requested page: a hit in the first tier holding it,
        a miss in every tier above (all tiers when none does). The admission policy
        sees every reference (frequency filters count here)."""
        self.admission.on_access(key)
        for t in self.tiers:
            if self.directory.is_committed(key, t.name):
                self.metrics.hits.inc(t.name)
                t.policy.on_access(key)
                return
            self.metrics.misses.inc(t.name)

    async def load(self, keys: Sequence[PageKey], pin: bool = True) -> LoadResult:
        """Bring ``keys`` to the top tier in one batched pass; pins each (until release)
        when ``pin``. Raises :class:`CapacityError` when they cannot all fit."""
        top = self.top
        d = self.directory
        uniq = list(dict.fromkeys(keys))
        if len(uniq) > top.capacity_pages:
            raise CapacityError(
                f"cannot load {len(uniq)} distinct pages into tier {top.name!r}, which holds "
                f"{top.capacity_pages} pages"
            )
        started = time.perf_counter()
        for k in keys:
            d.pin(k)
        ok = False
        try:
            await self._settle(uniq, [top])
            for k in uniq:
                self._count_lookup(k)
            failed: dict[PageKey, set[str]] = {k: set() for k in uniq}
            wanted = frozenset(uniq)
            for _round in range(2 * len(self.tiers) + 2):
                await self._settle(uniq, [top])  # fetched or evicted by someone else
                need = [k for k in uniq if not d.is_committed(k, top.name)]
                groups: dict[int, list[PageKey]] = {}
                moving: list[PageKey] = []
                for k in need:
                    src = self._source(k, failed[k])
                    if src is not None:
                        groups.setdefault(src.index, []).append(k)
                    elif any((k, t.name) in self._ops for t in self.tiers):
                        moving.append(k)  # on its way between lower tiers: wait for it
                if not groups:
                    if not moving:
                        break
                    await self._settle(moving)
                    continue
                jobs: list[tuple[list[PageKey], Tier, _Job]] = []
                for idx, group in groups.items():
                    src = self.tiers[idx]
                    for batch in _chunks(group, self._batch_size(top)):
                        job = self._launch_move(src, top, batch, Priority.FETCH, protect=wanted)
                        jobs.append((batch, src, job))
                results = await self._await_jobs([j for _, _, j in jobs])
                for (batch, src, _), res in zip(jobs, results, strict=True):
                    bad = [k for k, r in zip(batch, res, strict=True) if not r]
                    for k in bad:
                        failed[k].add(src.name)
                    if bad:
                        await self._purge_vanished(src, bad)
            if d.used(top.name) > top.high_pages:
                await self._trim(top, Priority.FETCH, wanted)
            ok = True
        finally:
            if not pin or not ok:
                for k in keys:
                    d.unpin(k)
            self._changed(*self.tiers)
        self.metrics.fetch_latency.observe(time.perf_counter() - started)
        slots: list[int | None] = []
        missing: list[PageKey] = []
        for k in keys:
            if d.is_committed(k, top.name):
                slots.append(top.arena.slot_of(k) if top.is_arena else None)
            else:
                slots.append(None)
                missing.append(k)
        return LoadResult(slots, missing)

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
        self._changed(*self.tiers)

    async def _purge_vanished(self, tier: Tier, keys: list[PageKey]) -> None:
        """Forget pages a store no longer holds (e.g. dropped after a failed checksum)."""
        if tier.is_arena:
            return
        try:
            present = await tier.backend.contains(keys)
        except Exception:
            return  # the tier is down: keep the entries, they may come back
        d = self.directory
        for k, here in zip(keys, present, strict=True):
            entry = d.get(k)
            if (
                not here
                and d.state(k, tier.name) is PageState.COMMITTED
                and entry is not None
                and not entry.inflight.get(tier.name)
            ):
                d.remove(k, tier.name)
                tier.policy.on_remove(k)
        self._changed(tier)

    async def read(self, keys: Sequence[PageKey], out: Sequence[np.ndarray]) -> list[bool]:
        """Copy each page from the highest tier holding it into ``out[i]``; ``False`` for a
        miss (absent, or every tier holding it failed or failed verification)."""
        d = self.directory
        n = len(keys)
        ok = [False] * n
        for k in dict.fromkeys(keys):
            self._count_lookup(k)
        tried: list[set[str]] = [set() for _ in range(n)]
        for _round in range(2 * len(self.tiers) + 2):
            groups: dict[int, list[int]] = {}
            moving: list[PageKey] = []
            for i, k in enumerate(keys):
                if ok[i]:
                    continue
                for t in self.tiers:
                    if t.name not in tried[i] and d.is_committed(k, t.name):
                        groups.setdefault(t.index, []).append(i)
                        break
                else:
                    if any((k, t.name) in self._ops for t in self.tiers):
                        moving.append(k)  # being evicted or written: wait, then look again
            if not groups:
                if not moving:
                    return ok
                await self._settle(moving)
                continue
            for idx, group in groups.items():
                tier = self.tiers[idx]
                # earlier groups awaited: re-check, so nothing evicted meanwhile is copied
                items = [i for i in group if d.is_committed(keys[i], tier.name)]
                if not items:
                    continue
                for i in items:
                    tried[i].add(tier.name)
                    d.begin_copy(keys[i], tier.name)
                start = time.perf_counter()
                try:
                    got = await tier.backend.get([keys[i] for i in items], [out[i] for i in items])
                except KVTierUsageError:
                    raise
                except Exception as exc:
                    tier.record_failure("get", len(items), exc)
                    got = [False] * len(items)
                finally:
                    for i in items:
                        d.end_copy(keys[i], tier.name)
                moved = sum(got)
                self.metrics.record_transfer(
                    f"{tier.name}->out",
                    moved,
                    moved * tier.backend.page_bytes,
                    time.perf_counter() - start,
                )
                bad = [keys[i] for i, g in zip(items, got, strict=True) if not g]
                for i, g in zip(items, got, strict=True):
                    ok[i] = g
                if bad:
                    self.metrics.failed.inc(tier.name, by=len(bad))
                    if len(bad) == len(items):
                        tier.record_failure("get", len(bad))
                    await self._purge_vanished(tier, bad)
                elif items:
                    tier.record_success()
                self._changed(tier)
        return ok

    async def prefetch(self, keys: Sequence[PageKey], deadline_s: float) -> PrefetchResult:
        """Start bringing ``keys`` to the top tier and return what arrived by the deadline.

        Pages still moving at the deadline keep moving in the background and are
        reported ``late``. Cancelling the caller cancels the batches not yet started.
        """
        if (
            isinstance(deadline_s, bool)
            or not isinstance(deadline_s, int | float)
            or not deadline_s >= 0  # also NaN
        ):
            raise KVTierUsageError(
                f"deadline_s must be >= 0 (seconds, a real number), got {deadline_s!r}"
            )
        try:
            timeout = float(deadline_s)
        except OverflowError:  # an int past the float range: no deadline
            timeout = math.inf
        top = self.top
        d = self.directory
        uniq = list(dict.fromkeys(keys))
        wanted = frozenset(uniq)
        arrived: list[PageKey] = []
        missing: list[PageKey] = []
        groups: dict[int, list[PageKey]] = {}
        waiting: list[PageKey] = []
        for k in uniq:
            if d.is_committed(k, top.name):
                arrived.append(k)
            elif (k, top.name) in self._ops:
                waiting.append(k)  # already on its way up (or out): wait for it
            elif (src := self._source(k, set())) is not None:
                groups.setdefault(src.index, []).append(k)
            else:
                missing.append(k)
        batches: list[tuple[list[PageKey], _Job]] = []
        for idx, group in groups.items():
            src = self.tiers[idx]
            for batch in _chunks(group, self._batch_size(top)):
                job = self._launch_move(src, top, batch, Priority.PREFETCH, protect=wanted)
                batches.append((batch, job))
        if waiting:
            job = self._launch(lambda _: self._prefetch_moving(waiting, wanted), Priority.PREFETCH)
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
                self.metrics.prefetch_pages.inc("cancelled", by=len(uniq) - len(arrived))
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
            self._spawn(self._trim(top, Priority.EVICT, wanted))
        self.metrics.prefetch_pages.inc("arrived", by=len(arrived))
        self.metrics.prefetch_pages.inc("late", by=len(late))
        self.metrics.prefetch_pages.inc("missing", by=len(missing))
        return PrefetchResult(arrived, late, missing)

    async def _prefetch_moving(self, keys: list[PageKey], wanted: Collection[PageKey]) -> None:
        """Wait for the operations already under way on ``keys`` in the top tier (a fetch
        or an eviction), then bring up those that did not end there."""
        top = self.top
        await self._settle(keys, [top])
        groups: dict[int, list[PageKey]] = {}
        for k in keys:
            if not self.directory.is_committed(k, top.name):
                src = self._source(k, set())
                if src is not None:
                    groups.setdefault(src.index, []).append(k)
        jobs = [
            self._launch_move(self.tiers[idx], top, batch, Priority.PREFETCH, protect=wanted)
            for idx, group in groups.items()
            for batch in _chunks(group, self._batch_size(top))
        ]
        await self._await_jobs(jobs)

    async def delete(self, keys: Sequence[PageKey]) -> int:
        """Remove ``keys`` from every tier; returns how many pages were removed.

        Raises :class:`KVTierUsageError` (before changing anything) for a pinned key.
        """
        d = self.directory
        uniq = list(dict.fromkeys(keys))
        for k in uniq:
            if d.is_pinned(k):
                raise KVTierUsageError(f"page {bytes(k).hex()} is pinned: release it first")
        removed = 0
        for tier in self.tiers:
            while True:
                await self._settle(uniq, [tier])
                busy = [
                    k for k in uniq if (e := d.get(k)) is not None and e.inflight.get(tier.name)
                ]
                if not busy:
                    break
                await tier.wait_change(_WAIT_RECHECK_S)
            here = [k for k in uniq if d.is_committed(k, tier.name) and not d.is_pinned(k)]
            if not here:
                continue
            fut = self._op_future()
            for k in here:
                d.begin_evict(k, tier.name)
                self._begin_op(k, tier, fut)
            # its own task: a cancelled caller cannot leave the index and the backend apart
            lingering = await asyncio.shield(self._spawn(self._remove(tier, here)))
            removed += len(here) - len(lingering)
        return removed

    async def _forget(self, tier: Tier, keys: list[PageKey]) -> set[PageKey]:
        """Delete ``keys`` (marked ``evicting``) from ``tier``'s backend and drop them from
        the index. Pages the backend still holds after a failed delete (it answered
        ``False`` or raised, and ``contains`` still finds them) go back to ``committed``
        and are returned: forgetting them would leave them counted by the backend and
        unreachable. When the backend cannot say, they are forgotten (misses)."""
        d = self.directory
        try:
            gone = await tier.backend.delete(keys)
        except KVTierUsageError:
            raise
        except Exception as exc:
            tier.record_failure("delete", len(keys), exc)
            gone = [False] * len(keys)
        lingering: set[PageKey] = set()
        failed = [k for k, g in zip(keys, gone, strict=True) if not g]
        if failed:
            try:
                held = await tier.backend.contains(failed)
            except KVTierUsageError:
                raise
            except Exception as exc:
                tier.record_failure("contains", len(failed), exc)
                held = [False] * len(failed)
            lingering = {k for k, h in zip(failed, held, strict=True) if h}
            if lingering:
                tier.record_failure("delete", len(lingering))
        for k in keys:
            if k in lingering:
                d.cancel_evict(k, tier.name)
            else:
                d.remove(k, tier.name)
                tier.policy.on_remove(k)
        return lingering

    async def _remove(self, tier: Tier, keys: list[PageKey]) -> set[PageKey]:
        """Delete ``keys`` (marked ``evicting`` by the caller) from ``tier`` (see
        :meth:`_forget`); returns those the backend still holds."""
        d = self.directory
        try:
            return await self._forget(tier, keys)
        finally:
            for k in keys:
                if d.state(k, tier.name) is PageState.EVICTING:
                    d.cancel_evict(k, tier.name)
                self._end_op(k, tier)
            self._changed(tier)

    async def drain(self) -> None:
        """Wait until every background task (write-through, late prefetches) is done.

        Cancelling the caller stops the wait only: the tasks belong to the pipeline and
        keep running (a started batch always finishes)."""
        while self._tasks:
            await asyncio.shield(asyncio.gather(*list(self._tasks), return_exceptions=True))

    async def cancel_all(self) -> None:
        """Cancel every task the pipeline runs, started batches included, and wait for
        their clean-up (reservations aborted, pages left where they were). For a close
        that was itself cancelled: nothing may keep running against closed backends."""
        while self._tasks:
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def flush(self) -> int:
        """Finish background work, then write every dirty page of a memory tier (held
        there and in no lower tier) down one tier, as the write policy allows. Pages stay
        where they are. Returns the pages written down."""
        await self.drain()
        written = 0
        d = self.directory
        for tier in self.tiers[:-1]:
            if not tier.is_arena:
                continue
            nxt = self.tiers[tier.index + 1]
            dirty = [
                k
                for k in d.keys_in(tier.name)
                if not d.below(k, tier.name, include_reserved=True) and self._wants_down(k)
            ]
            if not dirty:
                continue
            try:
                ok = await self._copy(tier, nxt, dirty, Priority.EVICT)
            except CapacityError as exc:
                _log.warning("flush blocked: pages stay dirty", tier=nxt.name, reason=str(exc))
                continue
            written += sum(ok)
            if not all(ok):
                _log.warning(
                    "flush could not write every dirty page down",
                    tier=tier.name,
                    to=nxt.name,
                    failed=len(ok) - sum(ok),
                )
        await self.drain()
        return written

    async def close(self) -> None:
        """Cancel prefetch batches not yet started, finish the rest, then flush.

        Only prefetches are cut short: their caller counts a cancelled batch as missing,
        whereas a cancelled load, store or write-down batch would hand a
        ``CancelledError`` to a caller (or an eviction) that was never cancelled."""
        for job in list(self._jobs):
            if job.priority is Priority.PREFETCH and not job.started and job.task is not None:
                job.task.cancel()
        await self.drain()
        await self.flush()
