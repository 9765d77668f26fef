"""Observers of a live cache: things that watch its requests without moving bytes.

A :class:`CacheObserver` attached to a :class:`~kvtier.cache.KVCache`
(:meth:`~kvtier.cache.KVCache.attach`) is told, on the event-loop thread, about every
``lookup`` (a request: its page keys in order and where the cached prefix was found),
every engine hint and the clock; its :meth:`~CacheObserver.stats` appear in
``KVCache.stats()`` under its ``name``. Observers never change what the cache does; one
that raises is logged and detached, never the caller's problem.

:class:`WhatIfObserver` runs :class:`kvtier.sim.whatif.WhatIf` on the cache's own tiers
and publishes its estimates as the ``kvtier_whatif_hit_rate{tier, capacity}`` gauge (and
the hit rate lookups really found, ``kvtier_whatif_measured_hit_rate{tier}``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from kvtier.config import KVTierConfig
from kvtier.keys import PageKey
from kvtier.metrics import CacheMetrics
from kvtier.policy.admission import make_admission
from kvtier.policy.eviction import make_policy
from kvtier.policy.hints import Hint
from kvtier.sim.whatif import FACTORS, TierModel, WhatIf
from kvtier.transfer.tier import Tier


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
    at its high watermark (what it holds once it has made room), with its configured
    eviction policy (without the leaf-first wrapper) and the cache's write policy.

    Args:
        cache: the cache to model (its tiers, policies and write policy, as configured).
        factors: capacity factors besides the current size.
        mini_pages: miniature size bound (see :class:`~kvtier.sim.whatif.WhatIf`).
        publish_every: lookups between two refreshes of the gauges (``stats()`` and every
            read-out of the cache's metrics, a Prometheus scrape included, refresh them
            too: :meth:`~kvtier.metrics.Metrics.refresh_on_read`).
    """

    name: ClassVar[str] = "whatif"

    def __init__(
        self,
        cache: SizedCache,
        factors: Sequence[float] = FACTORS,
        mini_pages: int = 4096,
        publish_every: int = 64,
    ) -> None:
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
                    max(tier.high_pages, 1),  # what the tier keeps after making room
                    functools.partial(make_policy, tc.eviction, **tc.eviction_params),
                    adm,
                )
            )
        self.tier_names = [tc.name for tc in cfg.tiers]
        self.whatif = WhatIf(models, cfg.write_policy, factors, mini_pages)
        self.publish_every = max(int(publish_every), 1)
        self._pages = 0
        self._found = [0] * len(self.tier_names)
        self._lookups = 0
        metrics = cache.metrics
        self._gauge = metrics.gauge(
            "whatif_hit_rate",
            "Estimated share of looked-up pages found at or above a tier if it had the "
            "given capacity (relative to its own)",
            ["tier", "capacity"],
        )
        self._measured = metrics.gauge(
            "whatif_measured_hit_rate",
            "Share of looked-up pages found at or above a tier (what lookups saw)",
            ["tier"],
        )
        self.stop_refreshing = metrics.refresh_on_read(self.publish)

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
        """Per tier: the estimates (see :meth:`WhatIf.estimates`) and ``measured``."""
        self.publish()
        est = self.whatif.estimates()
        for tier, rate in self.measured().items():
            est[tier]["measured_hit_rate"] = rate
        return {"lookups": self._lookups, "tiers": est}
