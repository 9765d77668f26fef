"""Review findings on the pipeline and the facade, each pinned by a test on real tiers.

Covers: concurrent stores and prefetches of the same pages (both callers see the page
committed), releasing more pins than were taken (a usage error that changes nothing),
a reservation failing for one namespace group of a batch (no space leaked in the
backend), and a cancelled ``delete`` (the directory still matches the backend).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from cache_kit import PAGE, FailingFileStore, SlowFileStore, config, sequence, tier
from kvtier.backends.filestore import FileStore

from kvtier.backend import BackendClosedError
from kvtier.cache import KVCache
from kvtier.errors import CapacityError, KVTierUsageError, TierIOError


class LabelFailingFileStore(FileStore):
    """A file store whose ``reserve`` raises for pages of one namespace label (as a store
    whose per-namespace area went away would)."""

    bad_label: ClassVar[str] = "bad"

    async def reserve(self, keys: Any, namespace: str = "") -> Any:
        if namespace == type(self).bad_label:
            raise TierIOError(f"injected: namespace {namespace!r} unavailable")
        return await super().reserve(keys, namespace)


class SlowWriteFileStore(FileStore):
    """A file store whose page writes sleep ``delay_s`` per batch in the executor thread,
    and which records, when closed, how many tasks ``pipeline`` was still running."""

    delay_s: ClassVar[float] = 0.2
    pipeline: ClassVar[Any] = None
    busy_at_close: ClassVar[list[int]] = []

    def _write_files(self, jobs: Any) -> Any:
        time.sleep(type(self).delay_s)
        return super()._write_files(jobs)

    async def close(self) -> None:
        if type(self).pipeline is not None:
            type(self).busy_at_close.append(len(type(self).pipeline._tasks))
        await super().close()


def _open(cfg: dict[str, Any]) -> KVCache:
    return KVCache(cfg, env={})


async def test_concurrent_stores_of_the_same_pages_both_report_them_stored(tmp_path: Path):
    """Two requests sharing a prompt store the same pages at once: the page is committed
    once, and both callers are told it is stored (keys are content addresses)."""
    rng = np.random.default_rng(21)
    async with _open(config(tmp_path, dram_pages=16, file_pages=64)) as cache:
        tokens, data = sequence(rng, 4)
        a, b = await asyncio.gather(cache.store(tokens, data), cache.store(tokens, data))
        assert a.stored == [True] * 4
        assert b.stored == [True] * 4
        out = np.zeros_like(data)
        assert all(await cache.read(a.keys, out))
        assert np.array_equal(out, data)
        cache.directory.check_invariants()


async def test_concurrent_prefetches_of_the_same_pages_both_see_them_arrive(tmp_path: Path):
    rng = np.random.default_rng(22)
    async with _open(config(tmp_path, dram_pages=16, file_pages=64)) as cache:
        tokens, data = sequence(rng, 4)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        await cache.pipeline._evict_shielded(cache.tiers[0], keys)
        assert [cache.directory.locate(k) for k in keys] == ["file"] * 4
        a, b = await asyncio.gather(
            cache.prefetch(keys, deadline_s=5), cache.prefetch(keys, deadline_s=5)
        )
        assert sorted(a.arrived) == sorted(keys) and a.missing == []
        assert sorted(b.arrived) == sorted(keys) and b.missing == []


async def test_releasing_more_pins_than_taken_is_a_usage_error_that_changes_nothing(
    tmp_path: Path,
):
    rng = np.random.default_rng(23)
    async with _open(config(tmp_path, dram_pages=16, file_pages=64)) as cache:
        tokens, data = sequence(rng, 2)
        keys = (await cache.store(tokens, data)).keys
        await cache.load(keys)  # one pin each
        with pytest.raises(KVTierUsageError, match=r"holds 1 pin\(s\), released 2 times"):
            cache.release([keys[0], keys[0]])
        assert all(cache.directory.is_pinned(k) for k in keys)  # nothing was released
        cache.release(keys)
        assert not any(cache.directory.is_pinned(k) for k in keys)
        cache.directory.check_invariants()


async def test_reserve_failing_for_one_namespace_group_leaks_no_space(tmp_path: Path):
    """A batch moving pages of two namespace labels reserves per label; when the second
    reserve raises, the first group's reservations are given back to the backend."""
    cfg = config(
        tmp_path,
        dram_pages=16,
        file_pages=64,
        file_backend="test_review_pipeline:LabelFailingFileStore",
        write_policy="write-back",
    )
    rng = np.random.default_rng(24)
    async with _open(cfg) as cache:
        good_keys = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(3)]
        bad_keys = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(3)]
        pages = rng.integers(0, 256, size=(3, PAGE), dtype=np.uint8)
        assert all(await cache.store_pages(good_keys, pages, namespace="good"))
        assert all(await cache.store_pages(bad_keys, pages, namespace="bad"))
        written = await cache.flush()  # one batch: "good" reserves, then "bad" raises
        file_tier = cache.tiers[1]
        assert written == 0
        assert cache.directory.used("file") == 0
        assert file_tier.backend.used_pages() == 0  # no reservation left behind
        cache.directory.check_invariants()


async def test_cancelled_delete_leaves_the_directory_matching_the_backend(tmp_path: Path):
    """Cancelling ``delete`` while a store is removing files must not leave the directory
    saying the pages are still there (lookup would report pages nobody can read)."""
    rng = np.random.default_rng(25)
    async with _open(config(tmp_path, dram_pages=16, file_pages=64)) as cache:
        tokens, data = sequence(rng, 4)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        await cache.pipeline._evict_shielded(cache.tiers[0], keys)
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
    cache = _open(cfg)
    await cache.start()
    tokens, data = sequence(rng, 4)
    keys = (await cache.store(tokens, data)).keys
    await cache.flush()
    await cache.pipeline._evict_shielded(cache.tiers[0], keys)
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


async def test_prefetch_of_pages_being_evicted_fetches_them_back(tmp_path: Path):
    """A page on its way out of the top tier when a prefetch asks for it is still in the
    hierarchy: the prefetch waits for the move, then brings it back up (it is not
    reported missing, which would make the engine recompute it)."""
    rng = np.random.default_rng(27)
    cfg = config(tmp_path, dram_pages=16, file_pages=64, write_policy="write-back")
    async with _open(cfg) as cache:
        tokens, data = sequence(rng, 4)
        keys = (await cache.store(tokens, data)).keys
        evicting = asyncio.create_task(cache.pipeline._evict_shielded(cache.tiers[0], keys))
        await asyncio.sleep(0)  # the pages are marked evicting, their write-down starts
        result = await cache.prefetch(keys, deadline_s=5)
        assert await evicting == set()
        assert result.missing == []
        assert sorted(result.arrived) == sorted(keys)
        out = np.zeros_like(data)
        assert all(await cache.read(keys, out))
        assert np.array_equal(out, data)


async def test_cancelling_flush_does_not_cancel_background_write_through(tmp_path: Path):
    """flush() waits for the background write-through; cancelling the flush caller must
    not cancel that work (it belongs to the pipeline, and its started batches are
    promised to finish), so every stored page still lands in the lower tier."""
    rng = np.random.default_rng(28)
    cfg = config(tmp_path, dram_pages=64, file_pages=256, batch_pages=2)
    async with _open(cfg) as cache:
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
        file_backend="test_review_pipeline:SlowWriteFileStore",
    )
    rng = np.random.default_rng(29)
    cache = _open(cfg)
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


async def test_capacity_error_names_the_policy_when_unpinned_pages_cannot_be_evicted(
    tmp_path: Path,
):
    """With leaf-first eviction in the last tier (where eviction drops pages), pinning
    only the last page of a cached chain leaves its unpinned ancestors un-evictable. The
    error must say so, not claim that everything is pinned. (Above the last tier those
    ancestors move down instead: test_prefix_tree's
    test_leaf_first_moves_ancestors_down_when_only_a_pinned_leaf_is_left.)"""
    rng = np.random.default_rng(30)
    cfg = config(tmp_path, dram_pages=10, file_pages=64)
    cfg["tiers"] = cfg["tiers"][:1]  # DRAM alone: the last tier
    async with _open(cfg) as cache:
        tokens, data = sequence(rng, 8)
        keys = (await cache.store(tokens, data)).keys
        await cache.load(keys[-1:])  # the chain's leaf only
        more, more_data = sequence(rng, 4)
        with pytest.raises(
            CapacityError,
            match=r"1 of its 10 pages are pinned or reserved; none of the other 7 can go "
            r"\(its eviction policy \(leaf-first\(adaptive\)\) offers none",
        ):
            await cache.store(more, more_data)
        cache.release(keys[-1:])
        assert all((await cache.store(more, more_data)).stored)


class SlowKeysFileStore(FileStore):
    """A file store whose ``keys()`` (the recovery scan at start-up) takes ``delay_s``."""

    delay_s: ClassVar[float] = 5.0

    async def keys(self) -> Any:
        await asyncio.sleep(type(self).delay_s)
        return await super().keys()


async def test_start_cancelled_during_recovery_closes_the_backends(tmp_path: Path):
    """A start-up cancelled while persistent tiers are being indexed (a server start-up
    timeout) must not leave opened backends (threads, files, memory) behind."""
    cfg = config(
        tmp_path,
        dram_pages=8,
        file_pages=64,
        file_backend="test_review_pipeline:SlowKeysFileStore",
    )
    cache = _open(cfg)
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


@pytest.mark.parametrize("deadline", [float("inf"), 10**400])
async def test_prefetch_with_an_unbounded_deadline_waits_for_everything(tmp_path: Path, deadline):
    """A deadline too large for a float (an int past 1e308) means 'no deadline', like inf;
    it must not raise OverflowError after the batches were launched."""
    rng = np.random.default_rng(31)
    async with _open(config(tmp_path, dram_pages=16, file_pages=64)) as cache:
        tokens, data = sequence(rng, 3)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        await cache.pipeline._evict_shielded(cache.tiers[0], keys)
        result = await cache.prefetch(keys, deadline)
        assert sorted(result.arrived) == sorted(keys)
        assert result.late == [] and result.missing == []


class DeleteFailingFileStore(FileStore):
    """A file store whose ``delete`` reports per-page failure (``False``, as the backend
    contract asks) while ``failing`` is set, leaving its pages in place, as a remote
    store that cannot reach its server does."""

    failing: ClassVar[bool] = False

    async def delete(self, keys: Any) -> list[bool]:
        if type(self).failing:
            return [False] * len(keys)
        return await super().delete(keys)


async def test_pages_whose_delete_fails_stay_indexed(tmp_path: Path):
    """An eviction (or a delete) whose backend delete fails must not forget pages the
    backend still holds: they stay readable, and the directory keeps agreeing with the
    backend's occupancy (forgotten pages would count against its capacity forever)."""
    DeleteFailingFileStore.failing = False
    cfg = config(
        tmp_path,
        dram_pages=16,
        file_pages=64,
        file_backend="test_review_pipeline:DeleteFailingFileStore",
    )
    rng = np.random.default_rng(32)
    async with _open(cfg) as cache:
        tokens, data = sequence(rng, 4)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        top, file_tier = cache.tiers
        await cache.pipeline._evict_shielded(top, keys)
        d = cache.directory
        DeleteFailingFileStore.failing = True
        stuck = await cache.pipeline._evict_shielded(file_tier, keys)  # the last tier: drop
        assert stuck == set(keys)
        assert await cache.delete(keys[:2]) == 0
        assert d.used("file") == file_tier.backend.used_pages() == 4
        out = np.zeros_like(data)
        assert all(await cache.read(keys, out))
        assert np.array_equal(out, data)
        DeleteFailingFileStore.failing = False
        assert await cache.delete(keys) == 4
        assert d.used("file") == file_tier.backend.used_pages() == 0
        d.check_invariants()


async def test_a_prefetch_never_evicts_what_its_own_earlier_batch_brought_up(tmp_path: Path):
    """Pins hold the top tier near its watermark; a prefetch split into two batches must
    not have the second batch make room by evicting the first batch's pages (they would
    be reported missing while they sit one tier down)."""
    rng = np.random.default_rng(33)
    cfg = config(tmp_path, dram_pages=6, file_pages=64, batch_pages=2)
    async with _open(cfg) as cache:
        held_tokens, held_data = sequence(rng, 3)
        held = (await cache.store(held_tokens, held_data)).keys
        tokens, data = sequence(rng, 3)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        up = [k for k in keys if cache.directory.is_committed(k, "dram")]
        await cache.pipeline._evict_shielded(cache.tiers[0], up)
        assert (await cache.load(held)).missing == []  # 3 of 6 pinned; high watermark 4
        assert not any(cache.directory.is_committed(k, "dram") for k in keys)
        result = await cache.prefetch(keys, deadline_s=5)
        assert result.missing == []
        assert sorted(result.arrived) == sorted(keys)
        assert all(cache.directory.is_committed(k, "dram") for k in keys)
        cache.release(held)
