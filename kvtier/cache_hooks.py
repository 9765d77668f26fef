"""Engine hints and observers of a live cache: what :class:`~kvtier.cache.KVCache` tells
hint-aware policies and attached observers, kept apart from the facade's data path.

:class:`CacheHooks` holds a cache's observers (:meth:`CacheHooks.attach`) and finds its
tiers' hint-aware eviction policies (:func:`~kvtier.policy.hints.hint_target`, looking
through wrappers such as leaf-first). The facade calls it at these points:

* a call that references pages (``store``, ``store_pages``, ``load``, ``read``,
  ``prefetch``, ``demote``), before the pipeline runs it: the clock ticks
  for hint-aware policies and observers (:meth:`CacheHooks.on_call`), so that an
  eviction the call triggers sees expired ``ttl`` hints and overdue predictions;
* a ``lookup`` (a request): the clock ticks, then observers see the keys and where the
  cached prefix was found (``on_lookup``);
* a ``load``: observers with an ``on_load`` hook see the keys;
* a ``hint``: counted (``kvtier_hints_total{kind}``), the clock ticks, then every
  hint-aware policy and every observer is told;
* ``stats()`` and ``close``: each observer's ``stats()`` under its name; each observer's
  ``aclose()``, if it has one (no observer can be attached once close has begun).

Observers follow :class:`~kvtier.observers.CacheObserver` (an optional ``on_load(keys)``
hook sees every ``load``; an optional ``on_attach()`` runs when it is attached and
``on_detach()`` when it is detached, by hand or after a failure; an optional ``async
aclose()`` runs when the cache closes). An observer never changes what the cache does:
one whose hook or ``stats()`` raises is logged and detached, never the caller's problem.
Everything runs on the event-loop thread.
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


#: What an observer must have besides ``name`` (see :class:`CacheObserver`).
OBSERVER_HOOKS = ("on_lookup", "on_hint", "on_time", "stats")


def check_observer(observer: object) -> str:
    """``observer``'s name, checked: raises :class:`KVTierUsageError` unless it is a
    :class:`CacheObserver` (``on_lookup``, ``on_hint``, ``on_time`` and ``stats``
    callable; the error names those missing) whose ``name`` is a non-empty string."""
    missing = [] if hasattr(observer, "name") else ["name"]
    missing += [h for h in OBSERVER_HOOKS if not callable(getattr(observer, h, None))]
    if missing or not isinstance(observer, CacheObserver):
        lacks = ", ".join(missing) or "a member of the protocol"
        raise KVTierUsageError(
            f"observer {observer!r:.80} is not a CacheObserver: it lacks {lacks}"
        )
    name = observer.name
    if not isinstance(name, str) or not name:
        raise KVTierUsageError(f"observer name must be a non-empty string, got {name!r}")
    return name


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
        self._closed = False  # close has begun (aclose)

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
            try:
                check_predictor(predictor)
            except KVTierUsageError as exc:  # here "none" is a name too
                raise KVTierUsageError(f"{exc}, none") from None
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
        """Attach ``observer`` (its ``on_attach()`` runs first, if it has one); returns a
        function that detaches it (see :meth:`detach`). Raises :class:`KVTierUsageError`
        once the cache's close has begun, for an object that is not a
        :class:`~kvtier.observers.CacheObserver` (naming what it lacks), for a ``name``
        that is not a non-empty string or is one ``stats()`` uses, and for a name already
        attached."""
        if self._closed:
            raise KVTierUsageError(
                f"KVCache is closed: cannot attach observer {getattr(observer, 'name', None)!r}"
            )
        name = check_observer(observer)
        if name in RESERVED:
            raise KVTierUsageError(
                f"observer name {name!r} is taken by KVCache.stats(); reserved: "
                f"{', '.join(RESERVED)}"
            )
        if any(o.name == name for o in self._observers):
            raise KVTierUsageError(
                f"a {name} observer is already attached: detach it first "
                f"(the function attach returned, or cache.hooks.detach({name!r}))"
            )
        on_attach = getattr(observer, "on_attach", None)
        if on_attach is not None:
            on_attach()
        self._observers.append(observer)

        def detach() -> None:
            self._detach(observer)

        return detach

    def detach(self, name: str) -> None:
        """Detach the observer named ``name`` (its ``on_detach()`` runs, if it has one:
        it stops publishing). Raises :class:`KVTierUsageError` when none is attached."""
        for obs in self._observers:
            if obs.name == name:
                self._detach(obs)
                return
        names = ", ".join(repr(o.name) for o in self._observers) or "none"
        raise KVTierUsageError(f"no observer named {name!r} is attached; attached: {names}")

    def _detach(self, observer: CacheObserver) -> None:
        """Remove ``observer`` (if attached) and run its ``on_detach()``; one that raises
        is logged."""
        if observer not in self._observers:
            return
        self._observers.remove(observer)
        on_detach = getattr(observer, "on_detach", None)
        if on_detach is None:
            return
        try:
            on_detach()
        except Exception as exc:  # an observer never breaks the cache
            _log.warning("observer on_detach failed", observer=observer.name, error=repr(exc))

    def _failed(self, observer: CacheObserver, what: str, exc: Exception) -> None:
        """``observer``'s ``what`` raised ``exc``: log it and detach the observer."""
        _log.warning(
            "observer failed; detached", observer=observer.name, hook=what, error=repr(exc)
        )
        self._detach(observer)

    def targets(self) -> list[HintAware]:
        """The tiers' hint-aware policies (found once the cache has tiers; none before)."""
        if self._targets is None:
            policies = self._policies()
            if not policies:  # not open yet: ask again next time
                return []
            self._targets = [a for p in policies if (a := hint_target(p)) is not None]
        return self._targets

    def _call(self, what: str, *args: Any) -> None:
        for obs in list(self._observers):
            hook = getattr(obs, what, None)
            if hook is None:
                continue  # an optional hook (on_load)
            try:
                hook(*args)
            except Exception as exc:  # an observer never breaks the cache
                self._failed(obs, what, exc)

    def _tick(self) -> float:
        now = time.monotonic()
        for target in self.targets():
            target.on_time(now)
        self._call("on_time", now)
        return now

    def on_call(self) -> None:
        """A cache call that references pages is about to run: the clock ticks for
        hint-aware policies and observers (nothing to do without either), so that what
        the call evicts is chosen at the current time."""
        if self._observers or self.targets():
            self._tick()

    def on_lookup(self, keys: Sequence[PageKey], found_tiers: Sequence[str]) -> None:
        """A lookup: the clock ticks, observers see it (nothing to do without either)."""
        if not self._observers and not self.targets():
            return
        self._tick()
        self._call("on_lookup", keys, found_tiers)

    def on_load(self, keys: Sequence[PageKey]) -> None:
        """A load (done): observers with an ``on_load`` hook see it (the clock ticked
        before the load, :meth:`on_call`)."""
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
        """Each observer's ``stats()`` under its name; one whose ``stats()`` raises is
        logged and detached, and left out."""
        out: dict[str, Any] = {}
        for obs in list(self._observers):
            try:
                out[obs.name] = obs.stats()
            except Exception as exc:  # an observer never breaks the cache
                self._failed(obs, "stats", exc)
        return out

    async def aclose(self) -> None:
        """Run each observer's ``aclose()``, if it has one (the cache is closing: no
        observer can be attached from now on)."""
        self._closed = True
        for obs in list(self._observers):
            aclose = getattr(obs, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception as exc:  # an observer never breaks the cache's close
                    _log.warning("observer aclose failed", observer=obs.name, error=repr(exc))
