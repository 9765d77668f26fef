"""A read whose pages sit in several tiers: the top tier's are claimed first, and the
tiers are read concurrently.

Before, the groups were read in the order of the first key of each: a prompt's older
pages (below) before its newer ones (on top). While the slow group was read, concurrent
stores evicted the top tier's pages of the read down to the slow tier, so the read found
them gone and went back to the slow tier for a second ``get``: the read took twice the
slow tier's latency (0.5 s -> 1.0 s in ``benchmarks/vllm_async_loads.py``'s set-up).
Now every group's pages are marked as being copied before any group is awaited.

The groups were also read one after another, so a read spanning two slow tiers (NVMe and
a remote pool) waited for the sum of their latencies; they now run concurrently.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fault_stores import SlowGetStore

from kvtier.cache import KVCache
from kvtier.testing.case import cancel_after


async def test_a_read_across_tiers_is_one_slow_get_while_stores_evict_the_top_tier(
    tmp_path: Path,
) -> None:
    cfg = {
        "model": {"preset": "tiny"},
        "log": {"level": "warning"},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": 4 * 512},
            {"name": "slow", "backend": "fault_stores:SlowGetStore", "capacity": 256 * 512,
             "options": {"path": str(tmp_path)}},
        ],
    }  # fmt: skip
    async with KVCache(cfg, env={}, configure_log=False) as cache:
        pt = cache.spec.page_tokens
        pages = np.random.default_rng(5).integers(0, 256, (12, cache.spec.page_bytes), np.uint8)
        keys = (await cache.store(np.arange(12 * pt), pages)).keys
        await cache.flush()
        on_top = [k for k in keys if cache.directory.is_committed(k, "dram")]
        assert on_top and len(on_top) < len(keys)  # the read spans both tiers
        SlowGetStore.gets.clear()

        async def evict_the_top_tier() -> None:
            for i in range(6):  # new pages push the read's top-tier pages down meanwhile
                await asyncio.sleep(0.02)
                fresh = np.arange(2 * pt) + 10_000 * (i + 1)
                await cache.store(fresh, np.zeros((2, cache.spec.page_bytes), np.uint8))

        out = np.zeros_like(pages)
        hits, _ = await asyncio.gather(cache.read(keys, out), evict_the_top_tier())
        assert all(hits) and np.array_equal(out, pages)
        assert not any(cache.directory.is_committed(k, "dram") for k in on_top)  # they moved
        assert SlowGetStore.gets == [len(keys) - len(on_top)]  # one slow get, not two


def three_tiers(tmp_path: Path) -> dict[str, Any]:
    """DRAM over two slow tiers, small enough that twelve pages span all three."""
    slow = "fault_stores:SlowGetStore"
    return {
        "model": {"preset": "tiny"},
        "log": {"level": "warning"},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": 2 * 512},
            {"name": "slow_a", "backend": slow, "capacity": 4 * 512,
             "options": {"path": str(tmp_path / "a")}},
            {"name": "slow_b", "backend": slow, "capacity": 256 * 512,
             "options": {"path": str(tmp_path / "b")}},
        ],
    }  # fmt: skip


def busy_pages(cache: KVCache) -> dict[str, int]:
    """Pages marked as being copied out, per tier of :func:`three_tiers`."""
    return {t: cache.directory.busy(t) for t in ("dram", "slow_a", "slow_b")}


async def stored_across_three_tiers(cache: KVCache) -> tuple[list[Any], np.ndarray]:
    pt = cache.spec.page_tokens
    pages = np.random.default_rng(7).integers(0, 256, (12, cache.spec.page_bytes), np.uint8)
    keys = list((await cache.store(np.arange(12 * pt), pages)).keys)
    await cache.flush()
    for tier in ("slow_a", "slow_b"):  # the read needs a get from each slow tier
        assert any(cache.directory.locate(k) == tier for k in keys), tier
    SlowGetStore.gets.clear()
    SlowGetStore.most_in_flight = 0
    return keys, pages


async def test_a_read_spanning_two_slow_tiers_reads_them_concurrently(tmp_path: Path) -> None:
    async with KVCache(three_tiers(tmp_path), env={}, configure_log=False) as cache:
        keys, pages = await stored_across_three_tiers(cache)
        out = np.zeros_like(pages)
        hits = await cache.read(keys, out)
        assert all(hits) and np.array_equal(out, pages)
        assert len(SlowGetStore.gets) == 2  # one get per slow tier
        assert SlowGetStore.most_in_flight == 2  # at once: the read waits for the slower
        assert busy_pages(cache) == {"dram": 0, "slow_a": 0, "slow_b": 0}


async def test_a_cancelled_read_raises_only_once_every_tier_s_get_has_ended(
    tmp_path: Path,
) -> None:
    async with KVCache(three_tiers(tmp_path), env={}, configure_log=False) as cache:
        keys, pages = await stored_across_three_tiers(cache)
        read = asyncio.ensure_future(cache.read(keys, np.zeros_like(pages)))
        for _ in range(200):  # both slow gets started (each sleeps 0.3 s first)
            if SlowGetStore.in_flight == 2:
                break
            await asyncio.sleep(0.005)
        assert SlowGetStore.in_flight == 2
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        assert SlowGetStore.in_flight == 0  # no get still writing into the caller's buffers
        assert busy_pages(cache) == {"dram": 0, "slow_a": 0, "slow_b": 0}
        out = np.zeros_like(pages)  # the cache still serves every page
        assert all(await cache.read(keys, out)) and np.array_equal(out, pages)


async def test_a_read_cancelled_at_any_loop_turn_leaves_no_page_marked_as_being_copied(
    tmp_path: Path,
) -> None:
    """Cancelled before its tier reads have even started (their tasks never run), a read
    still ends every copy it marked: a page left marked could never be evicted."""
    SlowGetStore.delay_s = 0.02
    try:
        async with KVCache(three_tiers(tmp_path), env={}, configure_log=False) as cache:
            keys, pages = await stored_across_three_tiers(cache)
            ended = []
            for turns in range(12):
                ended.append(await cancel_after(cache.read(keys, np.zeros_like(pages)), turns))
                busy = busy_pages(cache)
                assert busy == {"dram": 0, "slow_a": 0, "slow_b": 0}, (turns, busy)
            assert any(ended)  # some were cancelled mid-read
            out = np.zeros_like(pages)
            assert all(await cache.read(keys, out)) and np.array_equal(out, pages)
    finally:
        SlowGetStore.delay_s = 0.3
