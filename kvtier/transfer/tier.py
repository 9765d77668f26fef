"""A tier at run time: one opened backend with its limits, eviction policy and health.

The :class:`Tier` holds what the mover needs about one level of the hierarchy; it moves
no bytes and decides nothing (the planner decides from its limits and policy). Page
counts come from the directory (the single source of truth); ``claimed`` counts room
promised to batches that have not reserved yet, so two batches never count the same free
slot. Health tracking turns a failing backend into one warning per outage (and one info
line on recovery), not one line per page: an outage ends only once the tier's calls have
worked for :data:`RECOVERY_QUIET_S` seconds without a failure, so a tier that fails again
soon after working (a full disk that takes some writes and refuses the next) continues
the same outage instead of logging a warning and a recovery per flap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from kvtier.backend import ArenaBackend, Backend
from kvtier.config import TierConfig
from kvtier.errors import KVTierUsageError
from kvtier.health import Ended, Outage
from kvtier.index.directory import Directory, PageState
from kvtier.keys import PageKey
from kvtier.log import get_logger
from kvtier.plan.limits import TierLimits
from kvtier.policy.base import EvictionPolicy

_log = get_logger("kvtier.tier")

#: Seconds a failing tier's calls must keep working, with no failure, before its outage
#: counts as over ("tier recovered" is logged at the first call after that). A failure
#: sooner continues the outage: it is counted (``relapses`` in the recovery line), not
#: logged again.
RECOVERY_QUIET_S = 10.0

#: After a write-down from a tier failed, for this many seconds, while the tier below is
#: in an outage, room-making and trimming in the tier take only victims that need no
#: write-down (pages the tier below holds already, or that may be dropped) instead of
#: trying its dirty pages again; then one eviction tries.
WRITE_DOWN_RETRY_S = 1.0


def backend_failure(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a backend call, is that backend's failure (a miss, the
    tier marked failing) rather than the caller's business: any ``Exception`` but a
    usage error, and a ``CancelledError`` while the running task was not asked to cancel
    (a future inside the backend was cancelled: its executor or connection pool shut
    down). A real cancellation of the caller propagates."""
    if isinstance(exc, KVTierUsageError):
        return False
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        return task is not None and task.cancelling() == 0
    return isinstance(exc, Exception)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Tier:
    """One level of the hierarchy.

    Attributes:
        index: position, 0 = top.
        name: the configured name.
        config: the tier's configuration.
        backend: the backend instance (opened by the cache).
        policy: its eviction policy.
        limits: capacity and watermarks in pages (also as ``capacity_pages``,
            ``high_pages``, ``low_pages``).
        claimed: pages of room promised to batches that have not reserved them yet.
        reserving: pages the pipeline has reserved here and not yet committed or aborted
            (reservations taken outside the pipeline are not counted: they are held).
        leaving: evicting pages the evictor has decided to drop from here (see
            :meth:`stays`).
        outage: the tier's :class:`~kvtier.health.Outage` (quiet period
            :data:`RECOVERY_QUIET_S`): whether the last call worked, the logged outage.
        down_failed_at: when a write-down from here last failed (``time.monotonic``).
    """

    def __init__(
        self,
        index: int,
        config: TierConfig,
        backend: Backend,
        policy: EvictionPolicy,
    ) -> None:
        self.index = index
        self.name = config.name
        self.config = config
        self.backend = backend
        self.policy = policy
        self.limits = TierLimits.of(
            backend.capacity_pages, config.high_watermark, config.low_watermark
        )
        self.claimed = 0
        self.reserving = 0
        self.leaving: set[PageKey] = set()
        self.outage = Outage(RECOVERY_QUIET_S)
        self.down_failed_at = -float("inf")
        self._waiters: list[asyncio.Future[None]] = []

    def skips_write_downs(self, below: Tier | None) -> bool:
        """Whether evictions from here should take only victims that need no write-down
        for now: a write-down to ``below`` failed within :data:`WRITE_DOWN_RETRY_S` and
        ``below`` is still in its outage. Trying every dirty page again, batch by batch,
        on every store made stores under a dead lower tier cost the whole tier (a
        16-session bench run over a dead Valkey: 55 s, against 7 s on DRAM alone)."""
        return (
            below is not None
            and below.in_outage
            and time.monotonic() - self.down_failed_at < WRITE_DOWN_RETRY_S
        )

    def stays(self, key: PageKey, directory: Directory) -> bool:
        """Whether ``key``, being evicted from this tier, will still be here for a load
        that pins it now (the evictor has not yet decided it leaves)."""
        return directory.state(key, self.name) is PageState.EVICTING and key not in self.leaving

    @property
    def capacity_pages(self) -> int:
        """Pages the backend can hold."""
        return self.limits.capacity

    @property
    def high_pages(self) -> int:
        """Past this many pages eviction starts."""
        return self.limits.high

    @property
    def low_pages(self) -> int:
        """Eviction brings the tier down to this many pages."""
        return self.limits.low

    @property
    def is_arena(self) -> bool:
        """Whether the backend is a memory arena (slots with zero-copy views)."""
        return isinstance(self.backend, ArenaBackend)

    @property
    def arena(self) -> ArenaBackend:
        """The backend as an arena; raises ``TypeError`` for a store."""
        if not isinstance(self.backend, ArenaBackend):
            raise TypeError(f"tier {self.name!r} is a store, not an arena")
        return self.backend

    # -- change notification (for room-making waits) -------------------------------------

    def notify(self) -> None:
        """Wake every coroutine waiting for this tier's occupancy to change."""
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            _wake(fut)

    async def wait_change(self, timeout: float) -> None:
        """Wait until :meth:`notify` or ``timeout`` seconds pass (a safety net). A
        cancellation raises even when it comes with the notification (Python 3.11's
        ``asyncio.wait_for`` returned normally then: a cancelled load went on and
        returned its pages pinned to a caller that would never release them)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        timer = loop.call_later(timeout, _wake, fut)
        try:
            await fut
        finally:
            timer.cancel()
            if fut in self._waiters:
                self._waiters.remove(fut)

    # -- health --------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """Whether the last call that reached the backend worked (no failure since).
        A tier can be healthy while its logged outage is still open: see
        :attr:`in_outage`."""
        return self.outage.healthy

    @property
    def in_outage(self) -> bool:
        """Whether an outage was logged and its end not yet (the tier failed, and has not
        worked for :attr:`recovery_quiet_s` seconds since)."""
        return self.outage.since is not None

    @property
    def outages(self) -> int:
        """Outages logged so far (one warning each; flaps inside one are not counted)."""
        return self.outage.outages

    @property
    def recovery_quiet_s(self) -> float:
        """See :data:`RECOVERY_QUIET_S`."""
        return self.outage.quiet_s

    @recovery_quiet_s.setter
    def recovery_quiet_s(self, seconds: float) -> None:
        self.outage.quiet_s = seconds

    def record_failure(self, op: str, pages: int, cause: Any = None) -> None:
        """A call failed for ``pages`` pages: the tier is failing (not :attr:`healthy`)
        until a call works again. Logs a warning only when an outage starts; a failure
        within :attr:`recovery_quiet_s` seconds of the tier working again continues the
        outage it was recovering from (counted, not logged)."""
        self._log_recovery(self.outage.close_if_quiet())
        if self.outage.failed(pages):
            _log.warning(
                "tier failing: its pages are treated as misses",
                tier=self.name,
                op=op,
                pages=pages,
                cause=repr(cause) if cause is not None else "backend reported failure",
            )

    async def record_all_missed(self, op: str, keys: Sequence[PageKey]) -> list[bool] | None:
        """Every page of a ``get`` of ``keys`` missed: a failure (:meth:`record_failure`),
        except on a shared store (``Backend.shared``: a pool other servers use) that says
        it holds none of them. There pages vanish in normal operation (the server evicted
        them, they expired, another client deleted them): misses, not an outage; a
        ``contains`` that fails, or finds one of them still held, is one. A local store
        whose pages all vanished (its directory removed) is failing. Returns what
        ``contains`` answered, when it was asked and answered (``None`` otherwise)."""
        if not self.backend.shared:
            self.record_failure(op, len(keys))
            return None
        try:
            held = await self.backend.contains(keys)
        except BaseException as exc:
            if not backend_failure(exc):
                raise
            self.record_failure(op, len(keys), exc)
            return None
        if any(held):
            self.record_failure(op, len(keys))
        return held

    def record_success(self) -> None:
        """A call moved pages again: the tier is :attr:`healthy`. Logs "tier recovered"
        once per outage, at the first success after the tier worked for
        :attr:`recovery_quiet_s` seconds without a failure."""
        self._log_recovery(self.outage.succeeded())

    def _log_recovery(self, ended: Ended | None) -> None:
        """Log the end of an outage: how long the tier failed, pages failed, relapses."""
        if ended is not None:
            _log.info(
                "tier recovered",
                tier=self.name,
                outage_s=round(ended.seconds, 3),
                failed_pages=ended.failures,
                relapses=ended.relapses,
            )

    def describe(self) -> dict[str, Any]:
        """Plain-data summary (for inspection)."""
        return {
            "index": self.index,
            "name": self.name,
            "backend": self.config.backend,
            "kind": str(self.backend.kind),
            "capacity_pages": self.capacity_pages,
            "high_pages": self.high_pages,
            "low_pages": self.low_pages,
            "eviction": self.config.eviction,
            "healthy": self.healthy,
            "outages": self.outages,
            "outage_open": self.in_outage,
        }
