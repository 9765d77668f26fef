"""The live prefetch predictor: prediction inside a running cache, not only in replay.

:class:`LivePrefetcher` is a cache observer (:mod:`kvtier.observers`). On every
``lookup`` (a request arriving) it predicts pages the engine is about to need and starts
``KVCache.prefetch`` for those that sit below the top tier, with a deadline, in the
background; the engine's ``load`` then finds them in the top tier (or waits only for the
rest of their move):

* ``prefix`` (:class:`~kvtier.policy.prefetch.PrefixPredictor`): the request's own cached
  prefix, pulled up in order as soon as the request is looked up, so the copies overlap
  with whatever the engine does before it loads (queueing, scheduling, other layers);
* ``lookahead`` (:class:`~kvtier.policy.prefetch.LookaheadPredictor`, the source
  article's section 6.2): pages that followed the request's pages in earlier requests,
  weighted by how often and how far ahead.

Every page it moved up is tracked until it is used or leaves the top tier: counted as
``useful`` when a ``load`` or ``lookup`` finds it in the top tier, ``wasted`` when it is
evicted first (``kvtier_predicted_prefetch_pages_total{outcome}``, with ``issued``,
``arrived``, ``late`` and ``missing`` from the prefetch results). A page is issued once
while a prefetch of it runs (two lookups of one request do not move it twice) and
counted ``arrived`` or ``late`` once while tracked, so that ``arrived + late == useful +
wasted + tracked + forgotten`` (``forgotten``: dropped past ``track``) in
:meth:`LivePrefetcher.stats`, which counts this predictor's pages (the metric counts
those of every predictor the cache had). At most ``max_inflight`` prefetches run at once
(a request arriving while they are busy is not prefetched: the predictor never queues
behind itself). :meth:`aclose` (called by ``KVCache.close``) cancels what has not
started; so does a detach (``on_detach``), which also stops listening to the directory.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

from kvtier.errors import KVTierUsageError
from kvtier.index.directory import Directory
from kvtier.keys import PageKey
from kvtier.log import get_logger
from kvtier.metrics import CacheMetrics
from kvtier.observers import check_count, check_seconds, shared_counter
from kvtier.policy.hints import Hint
from kvtier.policy.prefetch import LIVE_PREDICTORS, LookaheadPredictor
from kvtier.transfer.pipeline import PrefetchResult
from kvtier.transfer.tier import Tier

_log = get_logger("kvtier.prefetcher")

#: Predictor names :class:`LivePrefetcher` accepts.
PREDICTORS: tuple[str, ...] = LIVE_PREDICTORS

#: The outcomes counted (``stats()["pages"]`` and the metric's ``outcome`` label).
OUTCOMES: tuple[str, ...] = ("issued", "arrived", "late", "missing", "useful", "wasted")

_OWNER = "live predictor"


def check_predictor(name: str) -> None:
    """Raise :class:`KVTierUsageError` unless ``name`` is one of :data:`PREDICTORS`."""
    if not isinstance(name, str) or name not in PREDICTORS:
        raise KVTierUsageError(f"unknown predictor {name!r}; known: {', '.join(PREDICTORS)}")


class PrefetchTarget(Protocol):
    """What :class:`LivePrefetcher` uses of the cache (a :class:`~kvtier.cache.KVCache`)."""

    @property
    def tiers(self) -> Sequence[Tier]:
        """The open tiers, top first."""

    @property
    def metrics(self) -> CacheMetrics:
        """Where the counters go."""

    @property
    def directory(self) -> Directory:
        """Where every page is (the predictor listens to it)."""

    async def prefetch(self, keys: Sequence[PageKey], deadline_s: float) -> PrefetchResult:
        """Move ``keys`` toward the top tier within ``deadline_s``."""


class LivePrefetcher:
    """Predicts and prefetches on every lookup (see the module docstring).

    Args:
        cache: the open cache to prefetch into.
        predictor: one of :data:`PREDICTORS`.
        deadline_s: each prefetch's deadline, finite seconds > 0 (pages later than this
            keep moving and are counted ``late``).
        max_inflight: prefetch calls running at once (an integer >= 1).
        max_pages: pages per prefetch call (an integer >= 1).
        track: pages tracked for useful/wasted at most (an integer >= 1; oldest
            forgotten first).

    Raises :class:`KVTierUsageError` naming a bad argument. Directory events reach it
    once it is attached (``on_attach``) until it is detached or closed.
    """

    name: ClassVar[str] = "predictor"

    def __init__(
        self,
        cache: PrefetchTarget,
        predictor: str = "prefix",
        deadline_s: float = 0.05,
        max_inflight: int = 4,
        max_pages: int = 256,
        track: int = 1 << 16,
    ) -> None:
        check_predictor(predictor)
        self.deadline_s = check_seconds(_OWNER, "deadline_s", deadline_s)
        self.max_inflight = check_count(_OWNER, "max_inflight", max_inflight)
        self.max_pages = check_count(_OWNER, "max_pages", max_pages)
        self.track = check_count(_OWNER, "track", track)
        self.cache = cache
        self.predictor = predictor
        self.use_prefix = "prefix" in predictor.split("+")
        self.lookahead = LookaheadPredictor() if "lookahead" in predictor.split("+") else None
        self.top = cache.tiers[0].name
        self._tasks: set[asyncio.Task[None]] = set()
        self._moved: OrderedDict[PageKey, None] = OrderedDict()  # moved up, not yet used
        self._inflight: set[PageKey] = set()  # in a prefetch still running (one at most)
        self.skipped = 0
        self.forgotten = 0  # dropped from tracking past ``track``
        self._counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self._metric = shared_counter(
            cache.metrics,
            "predicted_prefetch_pages_total",
            "Pages the live predictor prefetched, by outcome (issued, arrived, late, "
            "missing, useful, wasted)",
            ["outcome"],
        )
        self._unsubscribe: Callable[[], None] = _nothing

    def _inc(self, outcome: str, by: int = 1) -> None:
        """Count ``by`` pages of ``outcome`` (this predictor's and the cache's metric)."""
        if by:
            self._counts[outcome] += by
            self._metric.inc(outcome, by=by)

    # -- attach and detach ---------------------------------------------------------------

    def on_attach(self) -> None:
        """Attached to the cache: listen to its directory (pages leaving the top tier)."""
        self._unsubscribe()
        self._unsubscribe = self.cache.directory.subscribe(self)

    def on_detach(self) -> None:
        """Detached (by hand or after a failure): stop listening, cancel the prefetches
        still running (:meth:`aclose` waits for them)."""
        self._unsubscribe()
        self._unsubscribe = _nothing
        for t in list(self._tasks):
            t.cancel()

    # -- directory listener: a moved page leaving the top tier unused is wasted ----------

    def on_commit(self, key: PageKey, tier: str) -> None:
        """Directory listener hook (nothing to do on commit)."""

    def on_remove(self, key: PageKey, tier: str) -> None:
        """Directory listener: a page this predictor moved up left the top tier."""
        if tier == self.top and key in self._moved:
            del self._moved[key]
            self._inc("wasted")

    # -- observer hooks ----------------------------------------------------------------

    def _used(self, keys: Sequence[PageKey]) -> None:
        d = self.cache.directory
        for k in keys:
            if k in self._moved and d.is_committed(k, self.top):
                del self._moved[k]
                self._inc("useful")

    def on_load(self, keys: Sequence[PageKey]) -> None:
        """A ``load`` of ``keys``: moved pages it finds were useful."""
        self._used(keys)

    def on_lookup(self, keys: Sequence[PageKey], found_tiers: Sequence[str]) -> None:
        found = list(keys[: len(found_tiers)])
        self._used([k for k, t in zip(found, found_tiers, strict=True) if t == self.top])
        want: dict[PageKey, None] = {}
        if self.use_prefix:
            for k, t in zip(found, found_tiers, strict=True):
                if t != self.top:
                    want[k] = None
        if self.lookahead is not None:
            self.lookahead.observe(found)
            d = self.cache.directory
            for k in self.lookahead.predict(found):
                tier = d.locate(k)
                if tier is not None and tier != self.top:
                    want[k] = None
        for k in [k for k in want if k in self._inflight]:  # on its way up already
            del want[k]
        if not want:
            return
        if len(self._tasks) >= self.max_inflight:
            self.skipped += 1
            return
        batch = list(want)[: self.max_pages]
        self._inc("issued", len(batch))
        self._inflight.update(batch)
        task = asyncio.get_running_loop().create_task(self._prefetch(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def on_hint(self, hint: Hint, now_s: float) -> None:
        """Hints are for eviction policies; the prefetcher ignores them."""

    def on_time(self, now_s: float) -> None:
        """The prefetcher needs no clock."""

    async def _prefetch(self, keys: list[PageKey]) -> None:
        """Prefetch ``keys`` (issued, and in flight until this returns) and count what
        came of it."""
        try:
            res = await self.cache.prefetch(keys, self.deadline_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a prediction must never break the engine
            _log.warning("live prefetch failed", error=repr(exc), pages=len(keys))
            return
        finally:
            self._inflight.difference_update(keys)
        self._inc("missing", len(res.missing))
        self._track(res.arrived, "arrived")
        self._track(res.late, "late")
        d = self.cache.directory
        for k in res.arrived:
            if k in self._moved and not d.is_committed(k, self.top):  # evicted again
                del self._moved[k]
                self._inc("wasted")
        while len(self._moved) > self.track:
            self._moved.popitem(last=False)
            self.forgotten += 1

    def _track(self, keys: Sequence[PageKey], outcome: str) -> None:
        """Track ``keys`` (moved up, or still moving) and count those not tracked yet as
        ``outcome`` (a page is counted once while tracked)."""
        new = 0
        for k in keys:
            if k not in self._moved:
                new += 1
                self._moved[k] = None
            self._moved.move_to_end(k)
        self._inc(outcome, new)

    async def aclose(self) -> None:
        """Cancel prefetches still running, wait for them, and stop listening. Their own
        errors are dropped (closing anyway); a cancellation of the caller propagates."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        try:
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._unsubscribe()

    def stats(self) -> dict[str, Any]:
        """This predictor's page counts by outcome, pages still tracked and forgotten
        (``arrived + late == useful + wasted + tracked + forgotten``), requests skipped
        while busy."""
        return {
            "predictor": self.predictor,
            "pages": dict(self._counts),
            "tracked": len(self._moved),
            "forgotten": self.forgotten,
            "skipped_busy": self.skipped,
            "deadline_s": self.deadline_s,
        }


def _nothing() -> None:
    """Does nothing (not listening yet)."""
