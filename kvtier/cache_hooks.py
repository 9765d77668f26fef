"""Engine hints and observers of a live cache: what :class:`~kvtier.cache.KVCache` tells
hint-aware policies and attached observers, kept apart from the facade's data path.

:class:`CacheHooks` holds a cache's observers (:meth:`CacheHooks.attach`) and finds its
tiers' hint-aware eviction policies (:func:`~kvtier.policy.hints.hint_target`, looking
through wrappers such as leaf-first). The facade calls it at four points:

* a ``lookup`` (a request): the clock ticks for hint-aware policies and observers
  (``on_time``), then observers see the keys and where the cached prefix was found
  (``on_lookup``);
* a ``load``: observers with an ``on_load`` hook see the keys;
* a ``hint``: counted (``kvtier_hints_total{kind}``), the clock ticks, then every
  hint-aware policy and every observer is told;
* ``stats()`` and ``close``: each observer's ``stats()`` under its name; each observer's
  ``aclose()``, if it has one.

Observers follow :class:`~kvtier.observers.CacheObserver` (an optional ``on_load(keys)``
hook sees every ``load``; an optional ``async aclose()`` runs when the cache closes). An
observer never changes what the cache does: one whose hook raises is logged and
detached, never the caller's problem. Everything runs on the event-loop thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.log import get_logger
from kvtier.metrics import CacheMetrics
from kvtier.observers import CacheObserver, SizedCache, WhatIfObserver
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.hints import Hint, HintAware, hint_target
from kvtier.prefetcher import LivePrefetcher, PrefetchTarget, check_predictor

__all__ = ["CacheHooks", "CacheObserver", "HookedCache"]

_log = get_logger("kvtier.cache")

#: ``stats()`` keys an observer cannot take.
RESERVED = ("tiers", "skipped_tiers", "metrics")


class HookedCache(SizedCache, PrefetchTarget, Protocol):
    """What :meth:`CacheHooks.start` needs of the cache (a :class:`~kvtier.cache.KVCache`)."""


class CacheHooks:
    """The observers and hint-aware policies of one cache.

    Args:
        metrics: the cache's metrics (``hints_total`` is registered there).
        policies: the tiers' eviction policies, asked once, the first time they are
            needed (after the cache opened: policies never change afterwards).
    """

    def __init__(
        self, metrics: CacheMetrics, policies: Callable[[], Sequence[EvictionPolicy]]
    ) -> None:
        self._policies = policies
        self._observers: list[CacheObserver] = []
        self._targets: list[HintAware] | None = None
        self._hints_total = metrics.counter(
            "hints_total", "Engine hints received, by kind", ["kind"]
        )
        self._whatif = False
        self._predictor: str | None = None

    def want(self, whatif: bool, predictor: str | None) -> None:
        """Ask for what-if sizing and a live prefetch predictor (one of
        :data:`kvtier.prefetcher.PREDICTORS`; ``None`` or ``"none"``: no predictor),
        attached by :meth:`start`. Raises :class:`KVTierUsageError` for an unknown
        predictor, or a ``whatif`` that is not a bool."""
        if not isinstance(whatif, bool):
            raise KVTierUsageError(f"whatif must be True or False, got {whatif!r}")
        if predictor == "none":
            predictor = None
        if predictor is not None:
            check_predictor(predictor)
        self._whatif = bool(whatif)
        self._predictor = predictor

    def start(self, cache: HookedCache) -> None:
        """Attach what :meth:`want` asked for to ``cache``, which has just opened:
        :class:`~kvtier.observers.WhatIfObserver` and
        :class:`~kvtier.prefetcher.LivePrefetcher`."""
        if self._whatif:
            self.attach(WhatIfObserver(cache))
        if self._predictor is not None:
            self.attach(LivePrefetcher(cache, self._predictor))

    @property
    def observers(self) -> tuple[CacheObserver, ...]:
        """The attached observers, in attach order."""
        return tuple(self._observers)

    def attach(self, observer: CacheObserver) -> Callable[[], None]:
        """Attach ``observer``; returns a function that detaches it. Raises
        :class:`KVTierUsageError` for a name already attached or one ``stats()`` uses."""
        name = getattr(observer, "name", None)
        if (
            not isinstance(name, str)
            or name in RESERVED
            or any(o.name == name for o in self._observers)
        ):
            raise KVTierUsageError(f"cannot attach an observer named {name!r}")
        self._observers.append(observer)

        def detach() -> None:
            if observer in self._observers:
                self._observers.remove(observer)

        return detach

    def targets(self) -> list[HintAware]:
        """The tiers' hint-aware policies (found once)."""
        if self._targets is None:
            self._targets = [a for p in self._policies() if (a := hint_target(p)) is not None]
        return self._targets

    def _call(self, what: str, *args: Any) -> None:
        for obs in list(self._observers):
            hook = getattr(obs, what, None)
            if hook is None:
                continue  # an optional hook (on_load)
            try:
                hook(*args)
            except Exception as exc:  # an observer never breaks the cache
                _log.warning("observer failed; detached", observer=obs.name, error=repr(exc))
                if obs in self._observers:
                    self._observers.remove(obs)

    def _tick(self) -> float:
        now = time.monotonic()
        for target in self.targets():
            target.on_time(now)
        self._call("on_time", now)
        return now

    def on_lookup(self, keys: Sequence[PageKey], found_tiers: Sequence[str]) -> None:
        """A lookup: the clock ticks, observers see it (nothing to do without either)."""
        if not self._observers and not self.targets():
            return
        self._tick()
        self._call("on_lookup", keys, found_tiers)

    def on_load(self, keys: Sequence[PageKey]) -> None:
        """A load: observers with an ``on_load`` hook see it."""
        if self._observers:
            self._call("on_load", keys)

    def hint(self, hint: Hint) -> None:
        """An engine hint: counted, the clock ticks, policies and observers are told."""
        self._hints_total.inc(hint.kind)
        now = self._tick()
        for target in self.targets():
            target.on_hint(hint, now)
        self._call("on_hint", hint, now)

    def stats(self) -> dict[str, Any]:
        """Each observer's ``stats()`` under its name."""
        return {obs.name: obs.stats() for obs in list(self._observers)}

    async def aclose(self) -> None:
        """Run each observer's ``aclose()``, if it has one (the cache is closing)."""
        for obs in list(self._observers):
            aclose = getattr(obs, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception as exc:  # an observer never breaks the cache's close
                    _log.warning("observer aclose failed", observer=obs.name, error=repr(exc))
