"""The hint-aware policies' clock in a live cache: it moves on every call that references
pages, not only on ``lookup`` and ``hint``, so that an eviction a ``store`` triggers sees
the ``ttl`` hints that expired meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from kvtier.cache import KVCache
from kvtier.keys import PageKey
from kvtier.policy.hints import Hint

Tick = Callable[[KVCache], Awaitable[None]]


def _cfg() -> dict[str, Any]:
    """One 32-page DRAM tier (the tiny preset: 512-byte pages) with the hinted policy."""
    return {
        "model": {"preset": "tiny"},
        "tiers": [{"name": "dram", "backend": "dram", "capacity": "16KiB", "eviction": "hinted"}],
    }


def _pages(cache: KVCache, n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, (n, cache.spec.page_bytes), np.uint8)


async def _expired_pages_kept(tick: Tick) -> int:
    """Fill the tier, give 4 pages a 50 ms ``ttl``, wait past it, run ``tick``, then store
    8 more pages (the tier must evict): how many of the 4 expired pages stayed."""
    async with KVCache(_cfg(), env={}, configure_log=False) as cache:
        await cache.store(np.arange(80), _pages(cache, 20))
        expiring = (await cache.store(np.arange(1000, 1016), _pages(cache, 4))).keys
        cache.hint("ttl", expiring, 0.05)
        await asyncio.sleep(0.3)  # the ttl is over
        await tick(cache)
        await cache.store(np.arange(2000, 2032), _pages(cache, 8))
        await cache.flush()
        return sum(cache.directory.locate(k) is not None for k in expiring)


async def _nothing(cache: KVCache) -> None:
    """No call between the hint and the store."""


async def _on_call(cache: KVCache) -> None:
    """What the facade does before a call that references pages."""
    cache.hooks.on_call()


async def _load(cache: KVCache) -> None:
    """A load of two live pages (not the expired ones)."""
    await cache.load(cache.page_keys(np.arange(8)), pin=False)


async def test_on_call_ticks_the_clock_before_a_store_evicts() -> None:
    """Before, only lookup and hint moved the policies' clock: a store's eviction took
    live pages and kept the 4 whose ttl had expired."""
    assert await _expired_pages_kept(_on_call) == 0


async def test_a_load_moves_the_clock_for_later_evictions() -> None:
    """A load ticks the clock too (it did not): the next store evicts the expired pages."""
    assert await _expired_pages_kept(_load) == 0


async def test_a_store_alone_sees_expired_ttl_hints() -> None:
    """The store itself moves the clock before it evicts (no lookup, hint or load since)."""
    assert await _expired_pages_kept(_nothing) == 0


class ClockObserver:
    """Records the times ``on_time`` is told."""

    name = "clock"

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_lookup(self, keys: Sequence[PageKey], found_tiers: Sequence[str]) -> None:
        pass

    def on_hint(self, hint: Hint, now_s: float) -> None:
        pass

    def on_time(self, now_s: float) -> None:
        self.times.append(now_s)

    def stats(self) -> dict[str, Any]:
        return {"ticks": len(self.times)}


async def test_observers_see_the_clock_of_on_call_and_load() -> None:
    async with KVCache(_cfg(), env={}, configure_log=False) as cache:
        observer = ClockObserver()
        cache.attach(observer)
        keys = (await cache.store(np.arange(8), _pages(cache, 2))).keys
        assert len(observer.times) == 1  # the store ticked
        before = time.monotonic()
        cache.hooks.on_call()
        assert len(observer.times) == 2
        await cache.load(keys, pin=False)
        assert len(observer.times) >= 3
        assert before <= observer.times[1] <= observer.times[-1] <= time.monotonic()
        assert observer.times == sorted(observer.times)
