"""Observers of a live cache: things that watch its requests without moving bytes.

A :class:`CacheObserver` attached to a :class:`~kvtier.cache.KVCache`
(:meth:`~kvtier.cache.KVCache.attach`) is told, on the event-loop thread, about every
``lookup`` (a request: its page keys in order and where the cached prefix was found),
every engine hint and the clock; its :meth:`~CacheObserver.stats` appear in
``KVCache.stats()`` under its ``name``. Observers never change what the cache does; one
that raises is logged and detached, never the caller's problem. Besides the protocol, an
observer may have ``on_load(keys)``, ``on_attach()`` (run by ``attach``: start publishing),
``on_detach()`` (run when it is detached, by hand or after a failure: stop publishing)
and ``async aclose()`` (run when the cache closes).

Metrics an observer publishes are shared by the observers of its kind that a cache has
over its life (:func:`shared_gauge`, :func:`shared_counter`): a second ``WhatIfObserver``
attached after the first was detached publishes to the same gauges.

:class:`WhatIfObserver` runs :class:`kvtier.sim.whatif.WhatIf` on the cache's own tiers
and publishes its estimates as the ``kvtier_whatif_hit_rate{tier, capacity}`` gauge (and
the hit rate lookups really found, ``kvtier_whatif_measured_hit_rate{tier}``).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from kvtier.config import KVTierConfig
from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.metrics import CacheMetrics, Counter, Gauge, Histogram, Metrics
from kvtier.policy.admission import make_admission
from kvtier.policy.eviction import make_policy
from kvtier.policy.hints import Hint
from kvtier.sim.whatif import FACTORS, TierModel, WhatIf
from kvtier.transfer.tier import Tier

_M = TypeVar("_M", Gauge, Counter)


@runtime_checkable
class CacheObserver(Protocol):
    """What :meth:`KVCache.attach` accepts."""

    @property
    def name(self) -> str:
        """Where :meth:`KVCache.stats` puts :meth:`stats` (unique per cache)."""

    def on_lookup(self, keys: Sequence[PageKey], found_tiers: Sequence[str]) -> None:
        """A lookup of ``keys``; ``found_tiers[i]`` is the tier of ``keys[i]`` for the
        cached prefix (its length is the prefix length)."""

    def on_hint(self, hint: Hint, now_s: float) -> None:
        """An engine hint."""

    def on_time(self, now_s: float) -> None:
        """The clock moved on (``time.monotonic()``)."""

    def stats(self) -> dict[str, Any]:
        """What the observer reports (plain data)."""


def check_count(owner: str, name: str, value: object) -> int:
    """``value`` as an int, checked: raises :class:`KVTierUsageError` naming ``owner``,
    the argument ``name`` and ``value`` unless it is an integer (numpy's too, not a bool)
    >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise KVTierUsageError(f"{owner}: {name} must be an integer >= 1, got {value!r}")
    return int(value)


def check_seconds(owner: str, name: str, value: object) -> float:
    """``value`` as float seconds, checked: raises :class:`KVTierUsageError` naming
    ``owner``, the argument ``name`` and ``value`` unless it is a real number (not a
    bool), finite and > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise KVTierUsageError(f"{owner}: {name} must be a number of seconds, got {value!r}")
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise KVTierUsageError(f"{owner}: {name} must be finite and > 0 seconds, got {value!r}")
    return seconds


def _registered(metrics: Metrics, name: str) -> Counter | Gauge | Histogram | None:
    """The family ``name`` (without the prefix) of ``metrics``, if registered."""
    full = f"{metrics.prefix}_{name}"
    return next((f for f in metrics.families() if f.name == full), None)


def _mismatch(name: str, labels: Sequence[str], found: object) -> KVTierUsageError:
    return KVTierUsageError(
        f"metric {name!r} is registered already as {found!r:.120}, not as expected "
        f"(labels {tuple(labels)})"
    )


def _shared(
    metrics: Metrics, kind: type[_M], make: Callable[[str, str, Sequence[str]], _M],
    name: str, help: str, labels: Sequence[str],
) -> _M:  # fmt: skip
    """The metric ``name`` of ``metrics`` registered already, or a new one by ``make``;
    :class:`KVTierUsageError` when it is registered with another ``kind`` or labels."""
    found = _registered(metrics, name)
    if found is None:
        return make(name, help, labels)
    if not isinstance(found, kind) or found.labels != tuple(labels):
        raise _mismatch(name, labels, found)
    return found


def shared_gauge(metrics: Metrics, name: str, help: str, labels: Sequence[str]) -> Gauge:
    """The gauge ``name`` of ``metrics``: the one registered already (by an observer of
    the same kind before) or a new one. Raises :class:`KVTierUsageError` when ``name``
    is registered with another type or other labels."""
    return _shared(metrics, Gauge, metrics.gauge, name, help, labels)


def shared_counter(metrics: Metrics, name: str, help: str, labels: Sequence[str]) -> Counter:
    """The counter ``name`` of ``metrics``: the one registered already (by an observer of
    the same kind before; it goes on counting, as a counter must) or a new one. Raises
    :class:`KVTierUsageError` when ``name`` is registered with another type or labels."""
    return _shared(metrics, Counter, metrics.counter, name, help, labels)


class SizedCache(Protocol):
    """What :class:`WhatIfObserver` reads of the cache (a :class:`~kvtier.cache.KVCache`)."""

    @property
    def config(self) -> KVTierConfig:
        """The configuration (tiers, policies, write policy)."""

    @property
    def tiers(self) -> Sequence[Tier]:
        """The open tiers, top first."""

    @property
    def metrics(self) -> CacheMetrics:
        """Where the gauges go."""


class WhatIfObserver:
    """What-if sizing of a live cache (see :mod:`kvtier.sim.whatif`). A tier is modelled
    at its capacity with its watermarks (past the high one it evicts down to the low
    one, as the live tier does), its configured eviction policy (without the leaf-first
    wrapper) and the cache's write policy.

    Args:
        cache: the cache to model (its tiers, policies and write policy, as configured).
        factors: capacity factors besides the current size.
        mini_pages: miniature size bound (see :class:`~kvtier.sim.whatif.WhatIf`).
        publish_every: lookups between two refreshes of the gauges, an integer >= 1
            (``stats()`` and, while the observer is attached, every read-out of the
            cache's metrics, a Prometheus scrape included, refresh them too:
            :meth:`~kvtier.metrics.Metrics.refresh_on_read`).

    Raises :class:`KVTierUsageError` naming a bad argument. The gauges are shared with
    the cache's earlier what-if observers; one cache has one attached at a time.
    """

    name: ClassVar[str] = "whatif"

    def __init__(
        self,
        cache: SizedCache,
        factors: Sequence[float] = FACTORS,
        mini_pages: int = 4096,
        publish_every: int = 64,
    ) -> None:
        every = check_count("what-if observer", "publish_every", publish_every)
        cfg = cache.config
        models = []
        for i, (tc, tier) in enumerate(zip(cfg.tiers, cache.tiers, strict=True)):
            adm = (
                functools.partial(make_admission, cfg.admission, **cfg.admission_params)
                if cfg.write_policy == "selective" and i > 0
                else None
            )
            models.append(
                TierModel(
                    tc.name,
                    tier.capacity_pages,
                    functools.partial(make_policy, tc.eviction, **tc.eviction_params),
                    adm,
                    high_watermark=tc.high_watermark,
                    low_watermark=tc.low_watermark,
                )
            )
        self.tier_names = [tc.name for tc in cfg.tiers]
        self.whatif = WhatIf(models, cfg.write_policy, factors, mini_pages)
        self.publish_every = every
        self._pages = 0
        self._found = [0] * len(self.tier_names)
        self._lookups = 0
        self._metrics: Metrics = cache.metrics
        metrics = self._metrics
        self._gauge = shared_gauge(
            metrics,
            "whatif_hit_rate",
            "Estimated share of looked-up pages found at or above a tier if it had the "
            "given capacity (relative to its own)",
            ["tier", "capacity"],
        )
        self._measured = shared_gauge(
            metrics,
            "whatif_measured_hit_rate",
            "Share of looked-up pages found at or above a tier (what lookups saw)",
            ["tier"],
        )
        #: Stops the refresh on read-outs (set by :meth:`on_attach`).
        self.stop_refreshing: Callable[[], None] = _nothing
        self._detached = False  # detached from the cache: publishes no more

    def on_attach(self) -> None:
        """Attached to the cache: refresh the gauges on every read-out of its metrics
        (the gauges are cleared first: what an earlier what-if observer left goes)."""
        self.stop_refreshing()
        self._clear()
        self._detached = False
        self.stop_refreshing = self._metrics.refresh_on_read(self.publish)

    def on_detach(self) -> None:
        """Detached (by hand, or after a failure): stop refreshing, clear the gauges (no
        stale estimates are scraped while no what-if observer is attached)."""
        self.stop_refreshing()
        self.stop_refreshing = _nothing
        self._detached = True
        self._clear()

    def _clear(self) -> None:
        self._gauge.values.clear()
        self._measured.values.clear()

    def on_lookup(self, keys: Sequence[PageKey], found_tiers: Sequence[str]) -> None:
        self.whatif.on_request(keys)
        self._lookups += 1
        self._pages += len(keys)
        index = {n: i for i, n in enumerate(self.tier_names)}
        for t in found_tiers:
            i = index.get(t)
            if i is not None:
                self._found[i] += 1
        if self._lookups % self.publish_every == 0:
            self.publish()

    def on_hint(self, hint: Hint, now_s: float) -> None:
        self.whatif.on_hint(hint, now_s)

    def on_time(self, now_s: float) -> None:
        self.whatif.on_time(now_s)

    def measured(self) -> dict[str, float | None]:
        """Per tier, the share of looked-up pages lookups found at or above it."""
        out: dict[str, float | None] = {}
        total = 0
        for name, n in zip(self.tier_names, self._found, strict=True):
            total += n
            out[name] = total / self._pages if self._pages else None
        return out

    def publish(self) -> None:
        """Refresh the gauges from the current estimates."""
        for tier, est in self.whatif.estimates().items():
            for label, rate in est["hit_rate"].items():
                if rate is not None:
                    self._gauge.set(rate, tier, label)
        for tier, rate in self.measured().items():
            if rate is not None:
                self._measured.set(rate, tier)

    def stats(self) -> dict[str, Any]:
        """Per tier: the estimates (see :meth:`WhatIf.estimates`) and ``measured`` (the
        gauges are refreshed too, unless the observer was detached)."""
        if not self._detached:
            self.publish()
        est = self.whatif.estimates()
        for tier, rate in self.measured().items():
            est[tier]["measured_hit_rate"] = rate
        return {"lookups": self._lookups, "tiers": est}


def _nothing() -> None:
    """Does nothing (a refresh not started)."""
