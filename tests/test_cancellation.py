"""Cancellation and shutdown on real tiers: a cancelled delete, flush, close or start, a
close with calls in flight, and random cancellations during outages never leave the
directory and the backends apart, a task running, or a page half-done."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import numpy as np
import pytest
from cache_kit import (
    PAGE,
    FailingFileStore,
    SlowFileStore,
    SlowWriteFileStore,
    config,
    open_cache,
    sequence,
    stored_below_dram,
    tier,
)

from kvtier.backend import BackendClosedError
from kvtier.cache import KVCache
from kvtier.errors import CapacityError, KVTierUsageError


async def test_cancelled_delete_leaves_the_directory_matching_the_backend(tmp_path: Path):
    """Cancelling ``delete`` while a store is removing files must not leave the directory
    saying the pages are still there (lookup would report pages nobody can read)."""
    rng = np.random.default_rng(25)
    async with open_cache(config(tmp_path, dram_pages=16, file_pages=64)) as cache:
        tokens, data = sequence(rng, 4)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        await cache.demote("dram", keys)
        task = asyncio.create_task(cache.delete(keys))
        await asyncio.sleep(0)  # delete runs up to the store's executor hop
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await cache.pipeline.drain()
        d = cache.directory
        d.check_invariants()
        for t in cache.tiers:
            assert d.used(t.name) == t.backend.used_pages(), t.name
        hit = await cache.lookup(tokens)
        held = await cache.tiers[1].backend.contains(hit.keys)
        assert all(held)  # every page lookup reports is really there


async def test_close_lets_a_running_load_finish_and_refuses_new_calls(tmp_path: Path):
    """close() cancels only prefetches not yet started: a demand load already waiting for
    its batches is not handed a CancelledError it never asked for, and calls made once
    close has begun are refused with a clear error instead of racing the shutdown."""
    SlowFileStore.delay_s = 0.1
    cfg = config(
        tmp_path,
        dram_pages=32,
        file_pages=64,
        file_backend="cache_kit:SlowFileStore",
        batch_pages=1,
        max_inflight_per_link=1,
    )
    rng = np.random.default_rng(26)
    cache = open_cache(cfg)
    await cache.start()
    keys = await stored_below_dram(cache, rng, 4)
    load = asyncio.create_task(cache.load(keys, pin=False))
    await asyncio.sleep(0.05)  # first batch reading, the others queued on the link
    closing = asyncio.create_task(cache.close())
    await asyncio.sleep(0)
    more, more_data = sequence(rng, 1)
    with pytest.raises(KVTierUsageError, match="closing"):
        await cache.store(more, more_data)
    result = await load
    assert result.missing == []
    await cache.close()  # a second close waits for the first one
    assert closing.done()
    await closing
    current = asyncio.current_task()
    assert [t for t in asyncio.all_tasks() if t is not current] == []


async def test_cancelling_flush_does_not_cancel_background_write_through(tmp_path: Path):
    """flush() waits for the background write-through; cancelling the flush caller must
    not cancel that work (it belongs to the pipeline, and its started batches are
    promised to finish), so every stored page still lands in the lower tier."""
    rng = np.random.default_rng(28)
    cfg = config(tmp_path, dram_pages=64, file_pages=256, batch_pages=2)
    async with open_cache(cfg) as cache:
        tokens, data = sequence(rng, 12)
        keys = (await cache.store(tokens, data)).keys  # write-through starts
        flushing = asyncio.create_task(cache.flush())
        for _ in range(3):
            await asyncio.sleep(0)
        flushing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await flushing
        await cache.pipeline.drain()
        assert all(cache.directory.is_committed(k, "file") for k in keys)
        cache.directory.check_invariants()


async def test_cancelled_close_stops_pipeline_work_before_backends_close(tmp_path: Path):
    """A close() that is itself cancelled (a server shutting down) stops the pipeline's
    remaining work before the backends close: nothing keeps running against a closed
    backend, and no task is left behind."""
    SlowWriteFileStore.delay_s = 0.2
    SlowWriteFileStore.pipeline = None
    SlowWriteFileStore.busy_at_close = []
    cfg = config(
        tmp_path,
        dram_pages=64,
        file_pages=256,
        batch_pages=2,
        file_backend="cache_kit:SlowWriteFileStore",
    )
    rng = np.random.default_rng(29)
    cache = open_cache(cfg)
    await cache.start()
    SlowWriteFileStore.pipeline = cache.pipeline
    tokens, data = sequence(rng, 12)
    await cache.store(tokens, data)  # write-through starts in the background
    closing = asyncio.create_task(cache.close())
    await asyncio.sleep(0.05)  # write-down batches are writing
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert SlowWriteFileStore.busy_at_close == [0]
    current = asyncio.current_task()
    assert [t for t in asyncio.all_tasks() if t is not current] == []
    with pytest.raises(KVTierUsageError, match="closed"):
        await cache.store(tokens, data)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", ["write-through", "write-back"])
async def test_random_cancellations_and_outages_leak_nothing(tmp_path: Path, seed, policy):
    """Engine tasks store, load (pinned), read, prefetch and delete overlapping sequences
    over three tiers while some of them are cancelled at random points and the middle
    tier keeps failing and recovering. Afterwards: no pin, claim or reservation is left,
    the directory agrees with every backend, no read ever returned wrong bytes, and every
    page reported stored (and not deleted) reads back exactly."""
    FailingFileStore.failing = False
    cfg = config(
        tmp_path,
        dram_pages=10,
        file_pages=40,
        file_backend="cache_kit:FailingFileStore",
        extra_tiers=[tier("f2", "file", 400, options={"path": str(tmp_path / "f2")})],
        batch_pages=2,
        max_inflight_per_link=2,
        write_policy=policy,
    )
    rng = np.random.default_rng(seed)
    seqs = [sequence(rng, 3) for _ in range(12)]
    truth: dict[bytes, np.ndarray] = {}
    deleted: set[bytes] = set()
    async with KVCache(cfg, env={}, configure_log=False) as cache:

        async def op(kind: int, tokens: np.ndarray, data: np.ndarray) -> None:
            keys = cache.page_keys(tokens)
            if kind == 0:
                try:
                    res = await cache.store(tokens, data)
                except CapacityError:
                    return  # the top tier is pinned full right now
                truth.update({k: r for k, ok, r in zip(keys, res.stored, data, strict=True) if ok})
            elif kind == 1:
                try:
                    loaded = await cache.load(keys)
                except CapacityError:
                    return
                try:
                    arena = cache.tiers[0].arena
                    for slot, row in zip(loaded.slots, data, strict=True):
                        if slot is not None:
                            assert np.array_equal(arena.view(slot), row)
                    await asyncio.sleep(0.001)
                finally:
                    cache.release(keys)
            elif kind == 2:
                out = np.zeros_like(data)
                hits = await cache.read(keys, out)
                for hit, got, row in zip(hits, out, data, strict=True):
                    assert not hit or np.array_equal(got, row)
            elif kind == 3:
                await cache.prefetch(keys, deadline_s=0.005)
            elif kind == 4:
                deleted.update(keys)
                with contextlib.suppress(KVTierUsageError):  # a page pinned by a load
                    await cache.delete(keys)
            else:
                FailingFileStore.failing = not FailingFileStore.failing

        tasks: list[asyncio.Task[None]] = []
        for i in range(100):
            tokens, data = seqs[int(rng.integers(len(seqs)))]
            tasks.append(
                asyncio.create_task(op(int(rng.integers(6 if i % 5 else 4)), tokens, data))
            )
            if rng.random() < 0.5:
                await asyncio.sleep(0)
            if rng.random() < 0.3:
                tasks[int(rng.integers(len(tasks)))].cancel()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        FailingFileStore.failing = False
        errors = [r for r in results if isinstance(r, Exception)]
        assert errors == []  # (CancelledError is not an Exception)
        await cache.pipeline.drain()
        d = cache.directory
        d.check_invariants()
        assert not any(d.is_pinned(k) for k in d)
        for t in cache.tiers:
            assert (t.claimed, t.reserving) == (0, 0), t.name
            assert d.used(t.name) == t.backend.used_pages(), t.name
        kept = [k for k in truth if k not in deleted]
        out = np.zeros((len(kept), PAGE), dtype=np.uint8)
        assert all(await cache.read(kept, out))
        assert all(np.array_equal(row, truth[k]) for k, row in zip(kept, out, strict=True))


async def test_start_cancelled_during_recovery_closes_the_backends(tmp_path: Path):
    """A start-up cancelled while persistent tiers are being indexed (a server start-up
    timeout) must not leave opened backends (threads, files, memory) behind."""
    cfg = config(
        tmp_path,
        dram_pages=8,
        file_pages=64,
        file_backend="cache_kit:SlowKeysFileStore",
    )
    cache = open_cache(cfg)
    starting = asyncio.create_task(cache.start())
    for _ in range(500):  # until the backends are open and recovery is scanning
        if cache.tiers or starting.done():
            break
        await asyncio.sleep(0.01)
    assert cache.tiers and not starting.done()
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert not cache.is_open
    for t in cache.tiers:
        with pytest.raises(BackendClosedError):
            await t.backend.contains([bytes(16)])
