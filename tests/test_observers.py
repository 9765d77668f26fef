"""Observers of a live cache: what ``attach`` accepts, an observer that fails never breaks
``KVCache.stats()``, detaching stops what the observer publishes, and a what-if observer
can follow another on the same cache."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from kvtier.cache import KVCache
from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.observers import WhatIfObserver
from kvtier.policy.hints import Hint


def _cfg() -> dict[str, Any]:
    return {
        "model": {"preset": "tiny"},
        "tiers": [{"name": "dram", "backend": "dram", "capacity": "16KiB"}],
    }


def _open(**kwargs: Any) -> KVCache:
    return KVCache(_cfg(), env={}, configure_log=False, **kwargs)


class Quiet:
    """A well-behaved observer."""

    def __init__(self, name: str = "quiet") -> None:
        self.name = name

    def on_lookup(self, keys: Sequence[PageKey], found_tiers: Sequence[str]) -> None:
        pass

    def on_hint(self, hint: Hint, now_s: float) -> None:
        pass

    def on_time(self, now_s: float) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {"ok": True}


class FailingStats(Quiet):
    """An observer whose ``stats()`` raises."""

    def stats(self) -> dict[str, Any]:
        raise RuntimeError("injected: observer stats failed")


class NameOnly:
    """Not an observer: a name and nothing else."""

    name = "bare"


def _whatif_lines(cache: KVCache) -> list[str]:
    return [s for s in cache.metrics.to_prometheus().splitlines() if s.startswith("kvtier_whatif")]


async def _lookups(cache: KVCache, n: int) -> None:
    for i in range(n):
        await cache.lookup(np.arange(16) + 1000 * i)


# -- B: attach checks; a failing observer's stats() ---------------------------------------


async def test_an_observer_whose_stats_raises_is_detached_and_stats_goes_on() -> None:
    async with _open() as cache:
        cache.attach(FailingStats("failing"))
        cache.attach(Quiet())
        stats = cache.stats()  # raised RuntimeError before
        assert "failing" not in stats and stats["quiet"] == {"ok": True}
        assert [o.name for o in cache.hooks.observers] == ["quiet"]
        assert "failing" not in cache.stats()


@pytest.mark.parametrize(
    ("observer", "match"),
    [
        (NameOnly(), "is not a CacheObserver: it lacks on_lookup, on_hint, on_time, stats"),
        (object(), "is not a CacheObserver: it lacks name, on_lookup"),
        (Quiet(""), "observer name must be a non-empty string, got ''"),
        (Quiet(7), "observer name must be a non-empty string, got 7"),  # type: ignore[arg-type]
        (Quiet("metrics"), "observer name 'metrics' is taken by KVCache.stats"),
    ],
)
async def test_attach_refuses_what_is_not_an_observer(observer: Any, match: str) -> None:
    """attach took an object with only a name, after which every stats() raised
    AttributeError, and took the name ""."""
    async with _open() as cache:
        with pytest.raises(KVTierUsageError, match=match):
            cache.attach(observer)
        assert cache.hooks.observers == ()
        assert "tiers" in cache.stats()


async def test_attach_refuses_a_name_attached_already_until_it_is_detached() -> None:
    async with _open() as cache:
        detach = cache.attach(Quiet())
        with pytest.raises(KVTierUsageError, match="a quiet observer is already attached"):
            cache.attach(Quiet())
        detach()
        cache.attach(Quiet())
        cache.hooks.detach("quiet")
        assert cache.hooks.observers == ()
        with pytest.raises(KVTierUsageError, match="no observer named 'quiet' is attached"):
            cache.hooks.detach("quiet")


async def test_attach_after_close_is_a_usage_error() -> None:
    cache = await KVCache.open(_cfg(), env={}, configure_log=False)
    await cache.close()
    with pytest.raises(KVTierUsageError, match="KVCache is closed: cannot attach observer"):
        cache.attach(Quiet())
    assert cache.hooks.observers == ()


# -- C: a second what-if observer; detaching stops the gauges ------------------------------


async def test_a_second_whatif_observer_works_after_the_first_was_detached() -> None:
    """The second raised 'metric kvtier_whatif_hit_rate registered twice', also when the
    first came from KVCache(whatif=True)."""
    async with _open(whatif=True) as cache:
        with pytest.raises(KVTierUsageError, match="a whatif observer is already attached"):
            cache.attach(WhatIfObserver(cache))
        cache.hooks.detach("whatif")
        second = WhatIfObserver(cache, publish_every=1)
        detach = cache.attach(second)
        await _lookups(cache, 3)
        assert cache.stats()["whatif"]["lookups"] == 3
        assert 'kvtier_whatif_measured_hit_rate{tier="dram"} 0' in _whatif_lines(cache)
        detach()
        third = WhatIfObserver(cache)
        cache.attach(third)
        assert cache.stats()["whatif"]["lookups"] == 0


async def test_a_detached_whatif_observer_publishes_no_more() -> None:
    """Detaching never stopped the refresh: every scrape republished stale estimates."""
    async with _open() as cache:
        observer = WhatIfObserver(cache, publish_every=1)
        detach = cache.attach(observer)
        await _lookups(cache, 2)
        assert _whatif_lines(cache)  # published while attached
        detach()
        assert _whatif_lines(cache) == []  # cleared, and not refreshed by the scrape
        await _lookups(cache, 2)
        observer.stats()
        assert _whatif_lines(cache) == []


class BrokenWhatIf(WhatIfObserver):
    """A what-if observer whose ``on_lookup`` fails from the second lookup on (the cache
    detaches it)."""

    def on_lookup(self, keys: Sequence[PageKey], found_tiers: Sequence[str]) -> None:
        if self.stats()["lookups"]:
            raise RuntimeError("injected: on_lookup failed")
        super().on_lookup(keys, found_tiers)


async def test_an_observer_detached_after_a_failure_stops_publishing() -> None:
    async with _open() as cache:
        cache.attach(BrokenWhatIf(cache))
        await _lookups(cache, 1)
        assert _whatif_lines(cache)  # the refresh publishes the estimates
        await _lookups(cache, 1)  # the hook raises: logged and detached
        assert cache.hooks.observers == ()
        assert _whatif_lines(cache) == []
        cache.attach(WhatIfObserver(cache))  # and another one can take its place


# -- D: WhatIfObserver's arguments ---------------------------------------------------------


@pytest.mark.parametrize("value", ["x", math.nan, math.inf, 0, -3, 2.5, True, None])
async def test_whatif_publish_every_must_be_an_integer_of_at_least_one(value: Any) -> None:
    """'x' and nan raised a bare ValueError; 0 and -3 were silently taken as 1."""
    async with _open() as cache:
        with pytest.raises(
            KVTierUsageError, match=rf"publish_every must be an integer >= 1, got {value!r}"
        ):
            WhatIfObserver(cache, publish_every=value)


async def test_whatif_publish_every_takes_numpy_integers() -> None:
    async with _open() as cache:
        assert WhatIfObserver(cache, publish_every=np.int64(8)).publish_every == 8  # type: ignore[arg-type]
        assert WhatIfObserver(cache).publish_every == 64  # the default
