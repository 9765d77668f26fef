"""Prefetches: what arrives by the deadline, what is late or missing, partial progress
when cancelled, pages already moving, and a prefetch never evicting what it brought up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from cache_kit import (
    PAGE,
    SlowFileStore,
    config,
    open_cache,
    sequence,
    stored_below_dram,
)

from kvtier.cache import KVCache
from kvtier.index.directory import PageState


async def test_concurrent_prefetches_of_the_same_pages_both_see_them_arrive(tmp_path: Path):
    rng = np.random.default_rng(22)
    async with open_cache(config(tmp_path, dram_pages=16, file_pages=64)) as cache:
        keys = await stored_below_dram(cache, rng, 4)
        assert [cache.directory.locate(k) for k in keys] == ["file"] * 4
        a, b = await asyncio.gather(
            cache.prefetch(keys, deadline_s=5), cache.prefetch(keys, deadline_s=5)
        )
        assert sorted(a.arrived) == sorted(keys) and a.missing == []
        assert sorted(b.arrived) == sorted(keys) and b.missing == []


async def test_prefetch_of_pages_being_evicted_fetches_them_back(tmp_path: Path):
    """A page on its way out of the top tier when a prefetch asks for it is still in the
    hierarchy: the prefetch waits for the move, then brings it back up (it is not
    reported missing, which would make the engine recompute it)."""
    rng = np.random.default_rng(27)
    cfg = config(tmp_path, dram_pages=16, file_pages=64, write_policy="write-back")
    async with open_cache(cfg) as cache:
        tokens, data = sequence(rng, 4)
        keys = (await cache.store(tokens, data)).keys
        evicting = asyncio.create_task(cache.demote("dram", keys))
        await asyncio.sleep(0)  # the pages are marked evicting, their write-down starts
        result = await cache.prefetch(keys, deadline_s=5)
        assert await evicting == []
        assert result.missing == []
        assert sorted(result.arrived) == sorted(keys)
        out = np.zeros_like(data)
        assert all(await cache.read(keys, out))
        assert np.array_equal(out, data)


@pytest.mark.parametrize("deadline", [float("inf"), 10**400, np.float32(30), np.int64(30)])
async def test_prefetch_with_an_unbounded_deadline_waits_for_everything(tmp_path: Path, deadline):
    """A deadline too large for a float (an int past 1e308) means 'no deadline', like inf;
    it must not raise OverflowError after the batches were launched. numpy's numbers are
    seconds too (they were refused as not "a real number")."""
    rng = np.random.default_rng(31)
    async with open_cache(config(tmp_path, dram_pages=16, file_pages=64)) as cache:
        keys = await stored_below_dram(cache, rng, 3)
        result = await cache.prefetch(keys, deadline)
        assert sorted(result.arrived) == sorted(keys)
        assert result.late == [] and result.missing == []


async def test_a_prefetch_never_evicts_what_its_own_earlier_batch_brought_up(tmp_path: Path):
    """Pins hold the top tier near its watermark; a prefetch split into two batches must
    not have the second batch make room by evicting the first batch's pages (they would
    be reported missing while they sit one tier down)."""
    rng = np.random.default_rng(33)
    cfg = config(tmp_path, dram_pages=6, file_pages=64, batch_pages=2)
    async with open_cache(cfg) as cache:
        held_tokens, held_data = sequence(rng, 3)
        held = (await cache.store(held_tokens, held_data)).keys
        tokens, data = sequence(rng, 3)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        up = [k for k in keys if cache.directory.is_committed(k, "dram")]
        await cache.demote("dram", up)
        assert (await cache.load(held)).missing == []  # 3 of 6 pinned; high watermark 4
        assert not any(cache.directory.is_committed(k, "dram") for k in keys)
        result = await cache.prefetch(keys, deadline_s=5)
        assert result.missing == []
        assert sorted(result.arrived) == sorted(keys)
        assert all(cache.directory.is_committed(k, "dram") for k in keys)
        cache.release(held)


def _tier_of(cache: KVCache, key: bytes) -> str | None:
    return cache.directory.locate(key)


async def test_prefetch_deadline_returns_what_arrived(tmp_path):
    SlowFileStore.delay_s = 0.6
    cfg = config(
        tmp_path,
        dram_pages=32,
        file_pages=256,
        file_backend="cache_kit:SlowFileStore",
        batch_pages=2,
        max_inflight_per_link=1,
    )
    rng = np.random.default_rng(6)
    async with open_cache(cfg) as cache:
        tokens, data = sequence(rng, 6)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        hot = keys[:2]
        cold = keys[2:]
        # evict the cold ones from DRAM only (they are in the file tier after the flush),
        # so they must come up from the slow store
        top = cache.tiers[0]
        await cache.demote(top.name, cold)
        assert all(_tier_of(cache, k) == "file" for k in cold)

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        result = await cache.prefetch(keys, deadline_s=0.1)
        took = loop.time() - t0
        assert took < 0.5  # one slow read takes 0.6 s: the deadline was honoured
        assert set(result.arrived) == set(hot)
        assert set(result.late) == set(cold)
        assert result.missing == []
        await cache.pipeline.drain()  # late pages still land, in the background
        assert all(cache.directory.is_committed(k, "dram") for k in cold)
        out = np.zeros_like(data)
        assert all(await cache.read(keys, out))
        assert np.array_equal(out, data)


async def test_cancelled_prefetch_keeps_partial_progress_and_nothing_half_visible(tmp_path):
    SlowFileStore.delay_s = 0.15
    cfg = config(
        tmp_path,
        dram_pages=32,
        file_pages=256,
        file_backend="cache_kit:SlowFileStore",
        batch_pages=1,
        max_inflight_per_link=1,
        write_policy="write-through",
    )
    rng = np.random.default_rng(7)
    async with open_cache(cfg) as cache:
        tokens, data = sequence(rng, 6)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        await cache.demote("dram", keys)
        assert all(_tier_of(cache, k) == "file" for k in keys)

        task = asyncio.create_task(cache.prefetch(keys, deadline_s=10))
        await asyncio.sleep(0.2)  # first batch done, second one running
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await cache.pipeline.drain()
        d = cache.directory
        d.check_invariants()
        up = [k for k in keys if d.is_committed(k, "dram")]
        assert 1 <= len(up) < len(keys)  # partial progress kept, the rest never started
        assert d.count("dram", PageState.RESERVED) == 0  # nothing half-visible
        assert cache.tiers[0].backend.used_pages() == d.used("dram")
        out = np.zeros((len(up), PAGE), dtype=np.uint8)
        assert all(await cache.read(up, out))
        expected = np.stack([data[keys.index(k)] for k in up])
        assert np.array_equal(out, expected)
        assert cache.metrics.snapshot()["prefetch"]["cancelled"] > 0


async def test_close_cancels_unstarted_prefetches_and_leaves_no_task(tmp_path):
    SlowFileStore.delay_s = 0.25
    cfg = config(
        tmp_path,
        dram_pages=32,
        file_pages=256,
        file_backend="cache_kit:SlowFileStore",
        batch_pages=1,
        max_inflight_per_link=1,
    )
    rng = np.random.default_rng(12)
    cache = open_cache(cfg)
    await cache.start()
    keys = await stored_below_dram(cache, rng, 8)
    result = await cache.prefetch(keys, deadline_s=0.0)
    assert len(result.late) == len(keys)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await cache.close()
    assert loop.time() - t0 < 1.0  # 8 slow batches would take 2 s: most were cancelled
    current = asyncio.current_task()
    assert [t for t in asyncio.all_tasks() if t is not current] == []


async def test_a_load_racing_a_prefetch_of_the_same_pages_claims_no_room_for_them(
    tmp_path: Path,
):
    """A prefetch (the live predictor's, started at lookup) and the engine's load ask for
    the same pages before either has reserved them, so both launch a batch. The first
    batch brings the pages up (pinned by the load); the second must not claim room for
    pages already there: with a pinned tier that room does not exist, and the load used
    to fail with CapacityError."""
    rng = np.random.default_rng(41)
    async with open_cache(config(tmp_path, dram_pages=10, file_pages=64)) as cache:
        keys = await stored_below_dram(cache, rng, 8)
        assert [cache.directory.locate(k) for k in keys] == ["file"] * 8
        prefetch = asyncio.create_task(cache.prefetch(keys, deadline_s=5))
        await asyncio.sleep(0)  # the prefetch launched its batch; nothing reserved yet
        loaded = await cache.load(keys)
        assert loaded.missing == []
        assert all(cache.directory.is_committed(k, "dram") for k in keys)
        res = await prefetch
        assert res.missing == [] and sorted(res.arrived) == sorted(keys)
        cache.release(keys)
