"""Pipeline behaviour under pressure, on real tiers (DramArena over FileStores in tmp dirs).

Covers: round trips through every tier, spill and return with identical bytes,
watermarks after every store (with and without the background evictor), pins under
pressure, a pinned-full tier (CapacityError, no deadlock), batching (one backend call per
batch), bounded in-flight work per link, the link gate's priorities, write policies,
concurrent stores of the same pages, pins released twice, failing reservations and
deletes. Prefetches: tests/test_prefetch.py; room: tests/test_room.py; cancellation:
tests/test_cancellation.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from cache_kit import (
    PAGE,
    CountingFileStore,
    DeleteFailingFileStore,
    SlowFileStore,
    config,
    open_cache,
    sequence,
    stored_below_dram,
    tier,
)

from kvtier.cache import KVCache
from kvtier.config import register_admission
from kvtier.errors import CapacityError, KVTierUsageError
from kvtier.keys import ROOT_KEY
from kvtier.policy.base import AdmissionPolicy
from kvtier.policy.eviction import LRUKPolicy
from kvtier.policy.leaf_first import LeafFirstPolicy
from kvtier.transfer.links import Priority, PriorityGate


async def _store_many(cache: KVCache, rng: np.random.Generator, seqs: int, pages: int):
    out = []
    for _ in range(seqs):
        tokens, data = sequence(rng, pages)
        res = await cache.store(tokens, data)
        assert all(res.stored)
        out.append((tokens, data, res.keys))
    return out


def _tier_of(cache: KVCache, key: bytes) -> str | None:
    return cache.directory.locate(key)


async def test_round_trip_through_every_tier(tmp_path):
    """Pages stored at the top cascade down DRAM -> file -> file2 (store->store staging
    link) under pressure and come back up with identical bytes."""
    cfg = config(
        tmp_path,
        dram_pages=4,
        file_pages=8,
        extra_tiers=[tier("file2", "file", 64, options={"path": str(tmp_path / "f2")})],
        write_policy="write-back",
        batch_pages=4,
    )
    rng = np.random.default_rng(1)
    async with open_cache(cfg) as cache:
        seqs = await _store_many(cache, rng, 8, 3)
        located = {_tier_of(cache, k) for _, _, keys in seqs for k in keys}
        assert located == {"dram", "file", "file2"}
        for tokens, data, keys in seqs:
            hit = await cache.lookup(tokens)
            assert hit.keys == keys and hit.cached_tokens == len(tokens)
            loaded = await cache.load(keys)
            assert loaded.missing == []
            arena = cache.tiers[0].arena
            for slot, row in zip(loaded.slots, data, strict=True):
                assert slot is not None
                assert np.array_equal(arena.view(slot), row)
            cache.release(keys)
        cache.directory.check_invariants()
        links = cache.metrics.snapshot()["links"]
        for name in ("dram->file", "file->file2", "file2->dram", "file->dram"):
            assert links[name]["pages"] > 0, name
            assert links[name]["bytes"] == links[name]["pages"] * PAGE


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
async def test_spill_under_pressure_returns_identical_bytes(tmp_path, background):
    rng = np.random.default_rng(2)
    cfg = config(tmp_path, dram_pages=8, file_pages=512, background_eviction=background)
    async with open_cache(cfg) as cache:
        seqs = await _store_many(cache, rng, 12, 4)  # 48 pages over an 8-page DRAM
        if background:
            await cache.pipeline.drain()  # the evict queue catches up
        assert cache.directory.used("dram") <= cache.tiers[0].high_pages
        for _, data, keys in seqs:
            out = np.zeros_like(data)
            assert all(await cache.read(keys, out))
            assert np.array_equal(out, data)
        snap = cache.metrics.snapshot()
        assert snap["tiers"]["dram"]["hits"] > 0
        assert snap["tiers"]["file"]["hits"] > 0
        assert snap["tiers"]["dram"]["evicted_pages"] > 0


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
@pytest.mark.parametrize("policy", ["write-through", "write-back", "selective"])
async def test_watermarks_hold_after_every_store(tmp_path, policy, background):
    """Without the background evictor a store returns with the top tier at or below its
    high watermark; with it, the tier never exceeds its capacity and is back at or below
    the watermark once the evict queue has run."""
    rng = np.random.default_rng(3)
    cfg = config(
        tmp_path,
        dram_pages=10,
        file_pages=40,
        write_policy=policy,
        batch_pages=3,
        background_eviction=background,
    )
    async with open_cache(cfg) as cache:
        top, low = cache.tiers
        for _ in range(30):
            tokens, data = sequence(rng, int(rng.integers(1, 6)))
            await cache.store(tokens, data)
            assert cache.directory.used("dram") <= top.capacity_pages
            if background:
                await cache.pipeline.drain()
            assert cache.directory.used("dram") <= top.high_pages
            cache.directory.check_invariants()
        await cache.flush()
        assert cache.directory.used("file") <= low.high_pages
        # crossing the high watermark evicts down to the low one, not just below high
        assert top.low_pages < top.high_pages


async def test_pins_respected_under_pressure(tmp_path):
    rng = np.random.default_rng(4)
    async with open_cache(config(tmp_path, dram_pages=8, file_pages=512, batch_pages=2)) as cache:
        tokens, data = sequence(rng, 3)
        keys = (await cache.store(tokens, data)).keys
        loaded = await cache.load(keys)
        slots = list(loaded.slots)
        await _store_many(cache, rng, 20, 3)  # heavy pressure on the 8-page DRAM
        arena = cache.tiers[0].arena
        for k, slot, row in zip(keys, slots, data, strict=True):
            assert cache.directory.is_committed(k, "dram")
            assert arena.slot_of(k) == slot
            assert np.array_equal(arena.view(slot), row)
        cache.release(keys)
        await _store_many(cache, rng, 10, 3)
        assert not all(cache.directory.is_committed(k, "dram") for k in keys)


async def test_pinned_full_tier_raises_capacity_error_without_deadlock(tmp_path):
    rng = np.random.default_rng(5)
    async with open_cache(config(tmp_path, dram_pages=4, file_pages=64)) as cache:
        tokens, data = sequence(rng, 4)
        keys = (await cache.store(tokens, data)).keys
        await cache.load(keys)  # all four DRAM slots pinned
        other, other_data = sequence(rng, 1)
        with pytest.raises(CapacityError, match="pinned"):
            await asyncio.wait_for(cache.store(other, other_data), timeout=5)
        absent = bytes(range(16))
        with pytest.raises(CapacityError, match="holds 4 pages"):
            await cache.load([*keys, absent])
        cache.release(keys)
        assert all((await cache.store(other, other_data)).stored)


async def test_one_backend_call_per_batch(tmp_path):
    CountingFileStore.calls.clear()
    cfg = config(
        tmp_path,
        dram_pages=64,
        file_pages=256,
        file_backend="cache_kit:CountingFileStore",
        batch_pages=16,
    )
    rng = np.random.default_rng(8)
    async with open_cache(cfg) as cache:
        tokens, data = sequence(rng, 48)
        await cache.store(tokens, data)
        await cache.flush()  # write-through of 48 pages in batches of 16
        assert CountingFileStore.calls["write"] == 3
        keys = cache.page_keys(tokens)
        await cache.demote("dram", keys[:32])
        loaded = await cache.load(keys[:32])
        assert loaded.missing == []
        assert CountingFileStore.calls["get"] == 2


async def test_inflight_bounded_per_link(tmp_path):
    SlowFileStore.delay_s = 0.05
    SlowFileStore.max_concurrent = 0
    cfg = config(
        tmp_path,
        dram_pages=64,
        file_pages=256,
        file_backend="cache_kit:SlowFileStore",
        batch_pages=2,
        max_inflight_per_link=2,
    )
    rng = np.random.default_rng(9)
    async with open_cache(cfg) as cache:
        keys = await stored_below_dram(cache, rng, 16)
        loaded = await cache.load(keys)
        assert loaded.missing == []
        assert SlowFileStore.max_concurrent == 2
        assert cache.metrics.snapshot()["links"]["file->dram"]["batches"] == 8


async def test_gate_serves_fetch_before_prefetch_before_evict():
    gate = PriorityGate(1)
    await gate.acquire(Priority.FETCH)
    order: list[str] = []

    async def waiter(p: Priority, label: str) -> None:
        async with gate.slot(p):
            order.append(label)

    tasks = [
        asyncio.create_task(waiter(Priority.EVICT, "evict")),
        asyncio.create_task(waiter(Priority.PREFETCH, "prefetch")),
        asyncio.create_task(waiter(Priority.FETCH, "fetch")),
    ]
    await asyncio.sleep(0)
    assert gate.depth() == 3
    cancelled = asyncio.create_task(waiter(Priority.FETCH, "never"))
    await asyncio.sleep(0)
    cancelled.cancel()
    gate.release()
    await asyncio.gather(*tasks)
    assert order == ["fetch", "prefetch", "evict"]
    assert gate.active == 0 and gate.depth() == 0


async def test_lru_k_selectable_per_tier(tmp_path):
    cfg = config(tmp_path)
    cfg["tiers"][0]["eviction"] = "lru-k"
    cfg["tiers"][0]["eviction_params"] = {"k": 3}
    async with open_cache(cfg) as cache:
        policy = cache.tiers[0].policy
        assert isinstance(policy, LeafFirstPolicy)  # leaf_first is on by default
        assert isinstance(policy.inner, LRUKPolicy)
        assert policy.inner.k == 3
    cfg["pipeline"] = {"leaf_first": False}
    async with open_cache(cfg) as cache:
        assert isinstance(cache.tiers[0].policy, LRUKPolicy)


class _EvenFirstByte(AdmissionPolicy):
    name = "even-first-byte"

    def admit(self, key: bytes) -> bool:  # type: ignore[override]
        return key[0] % 2 == 0


async def test_selective_write_policy_admits_only_what_the_policy_accepts(tmp_path):
    register_admission("even-first-byte", _EvenFirstByte)
    cfg = config(
        tmp_path,
        dram_pages=8,
        file_pages=256,
        write_policy="selective",
        admission="even-first-byte",
    )
    rng = np.random.default_rng(10)
    async with open_cache(cfg) as cache:
        seqs = await _store_many(cache, rng, 10, 4)
        await cache.flush()
        keys = [k for _, _, ks in seqs for k in ks]
        for k in keys:
            in_file = cache.directory.is_committed(k, "file")
            assert in_file == (k[0] % 2 == 0)
        assert cache.metrics.snapshot()["tiers"]["dram"]["dropped_pages"] > 0


class _Recording(AdmissionPolicy):
    name = "recording"
    instances: ClassVar[list[_Recording]] = []

    def __init__(self) -> None:
        self.accessed: list[bytes] = []
        self.parents: list[tuple[bytes, bytes | None]] = []
        _Recording.instances.append(self)

    def admit(self, key: bytes) -> bool:  # type: ignore[override]
        return True

    def on_access(self, key: bytes) -> None:  # type: ignore[override]
        self.accessed.append(key)

    def note_parent(self, key: bytes, parent: bytes | None) -> None:  # type: ignore[override]
        self.parents.append((key, parent))


async def test_admission_policy_sees_every_reference_and_each_pages_parent(tmp_path):
    register_admission("recording", _Recording)
    cfg = config(tmp_path, write_policy="selective", admission="recording")
    rng = np.random.default_rng(12)
    async with open_cache(cfg) as cache:
        policy = _Recording.instances[-1]
        tokens = rng.integers(0, 1000, 3 * cache.spec.page_tokens)
        pages = np.zeros((3, cache.spec.page_bytes), dtype=np.uint8)
        stored = await cache.store(tokens, pages)
        keys = stored.keys
        assert policy.parents == [(keys[0], ROOT_KEY), (keys[1], keys[0]), (keys[2], keys[1])]
        out = [np.empty(cache.spec.page_bytes, dtype=np.uint8) for _ in keys]
        assert all(await cache.read(keys, out))
        assert policy.accessed == keys + keys  # stored once, read once


async def test_close_drains_and_write_back_flushes_dirty_pages(tmp_path):
    rng = np.random.default_rng(11)
    cfg = config(tmp_path, dram_pages=32, file_pages=256, write_policy="write-back")
    cache = open_cache(cfg)
    await cache.start()
    seqs = await _store_many(cache, rng, 4, 4)
    keys = [k for _, _, ks in seqs for k in ks]
    assert not any(cache.directory.is_committed(k, "file") for k in keys)  # still dirty
    await cache.close()
    current = asyncio.current_task()
    assert [t for t in asyncio.all_tasks() if t is not current] == []
    # a fresh cache on the same directory recovers every page from the file tier
    async with open_cache(cfg) as again:
        for _, data, ks in seqs:
            assert [again.directory.locate(k) for k in ks] == ["file"] * len(ks)
            out = np.zeros_like(data)
            assert all(await again.read(ks, out))
            assert np.array_equal(out, data)


@pytest.mark.parametrize("policy", ["write-through", "write-back"])
async def test_concurrent_engine_tasks_keep_every_page_intact(tmp_path, policy):
    """Many tasks store, load (pinned), read, prefetch and release overlapping sequences
    at once over a small DRAM: no deadlock, no wrong byte, a consistent directory."""
    rng = np.random.default_rng(13)
    cfg = config(
        tmp_path,
        dram_pages=12,
        file_pages=512,
        batch_pages=3,
        max_inflight_per_link=2,
        write_policy=policy,
    )
    seqs = [sequence(rng, 3) for _ in range(10)]
    async with open_cache(cfg) as cache:
        truth: dict[bytes, np.ndarray] = {}
        # an engine bounds what it pins at once (here 2 x 3 pages of a 12-page tier); more
        # would be a CapacityError, which test_pinned_full_tier_... covers
        pin_budget = asyncio.Semaphore(2)

        async def worker(seed: int) -> None:
            wrng = np.random.default_rng(seed)
            for _ in range(15):
                tokens, data = seqs[int(wrng.integers(len(seqs)))]
                keys = cache.page_keys(tokens)
                op = int(wrng.integers(4))
                if op == 0:
                    res = await cache.store(tokens, data)
                    truth.update(
                        {k: row for k, ok, row in zip(keys, res.stored, data, strict=True) if ok}
                    )
                elif op == 1:
                    async with pin_budget:
                        loaded = await cache.load(keys)
                        arena = cache.tiers[0].arena
                        for slot, row in zip(loaded.slots, data, strict=True):
                            if slot is not None:  # keys are content addresses: same bytes
                                assert np.array_equal(arena.view(slot), row)
                        await asyncio.sleep(0)
                        cache.release(keys)
                elif op == 2:
                    known = [k in truth for k in keys]
                    out = np.zeros_like(data)
                    ok = await cache.read(keys, out)
                    for was_stored, hit, got, row in zip(known, ok, out, data, strict=True):
                        assert hit or not was_stored  # nothing committed is ever lost
                        if hit:
                            assert np.array_equal(got, row)
                else:
                    await cache.prefetch(keys, deadline_s=0.01)

        await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(8))), timeout=60)
        await cache.pipeline.drain()
        d = cache.directory
        d.check_invariants()
        for t in cache.tiers:
            assert d.used(t.name) == t.backend.used_pages()
        assert not any(d.is_pinned(k) for k in truth)
        keys = list(truth)
        out = np.zeros((len(keys), PAGE), dtype=np.uint8)
        assert all(await cache.read(keys, out))
        assert all(np.array_equal(row, truth[k]) for k, row in zip(keys, out, strict=True))


async def test_pages_moved_down_keep_their_namespace_label(tmp_path):
    """A page written down by the pipeline is labelled with the namespace it was stored
    under, so `kvtier inspect store` can tell caches apart."""
    from kvtier.backends.nvme_inspect import inspect_store

    cfg = config(tmp_path, dram_pages=4, file_pages=64, file_backend="nvme")
    rng = np.random.default_rng(13)
    async with open_cache(cfg) as cache:
        seqs = await _store_many(cache, rng, 3, 4)
        await cache.flush()
        label = cache.namespace.label
        moved = sum(cache.directory.is_committed(k, "file") for _, _, ks in seqs for k in ks)
    report = inspect_store(tmp_path / "file")
    assert moved > 0
    assert report["namespaces"] == {label: {"pages": moved, "bytes": report["bytes"]}}


async def test_concurrent_stores_of_the_same_pages_both_report_them_stored(tmp_path: Path):
    """Two requests sharing a prompt store the same pages at once: the page is committed
    once, and both callers are told it is stored (keys are content addresses)."""
    rng = np.random.default_rng(21)
    async with open_cache(config(tmp_path, dram_pages=16, file_pages=64)) as cache:
        tokens, data = sequence(rng, 4)
        a, b = await asyncio.gather(cache.store(tokens, data), cache.store(tokens, data))
        assert a.stored == [True] * 4
        assert b.stored == [True] * 4
        out = np.zeros_like(data)
        assert all(await cache.read(a.keys, out))
        assert np.array_equal(out, data)
        cache.directory.check_invariants()


async def test_releasing_more_pins_than_taken_is_a_usage_error_that_changes_nothing(
    tmp_path: Path,
):
    rng = np.random.default_rng(23)
    async with open_cache(config(tmp_path, dram_pages=16, file_pages=64)) as cache:
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
        file_backend="cache_kit:LabelFailingFileStore",
        write_policy="write-back",
    )
    rng = np.random.default_rng(24)
    async with open_cache(cfg) as cache:
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


@pytest.mark.parametrize("unanswered", [False, True], ids=["contains-answers", "contains-raises"])
async def test_pages_whose_delete_fails_stay_indexed(tmp_path: Path, unanswered: bool):
    """An eviction (or a delete) whose backend delete fails must not forget pages the
    backend still holds: they stay readable, and the directory keeps agreeing with the
    backend's occupancy (forgotten pages would count against its capacity forever). So
    too when ``contains`` cannot say either (an outage): the pages are kept, as
    ``purge_vanished`` keeps them, and the delete is not counted."""
    DeleteFailingFileStore.failing = False
    DeleteFailingFileStore.unanswered = unanswered
    cfg = config(
        tmp_path,
        dram_pages=16,
        file_pages=64,
        file_backend="cache_kit:DeleteFailingFileStore",
    )
    rng = np.random.default_rng(32)
    async with open_cache(cfg) as cache:
        tokens, data = sequence(rng, 4)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        top, file_tier = cache.tiers
        await cache.demote(top.name, keys)
        d = cache.directory
        DeleteFailingFileStore.failing = True
        stuck = await cache.demote(file_tier.name, keys)  # the last tier: drop
        assert set(stuck) == set(keys)
        assert await cache.delete(keys[:2]) == 0
        assert d.used("file") == file_tier.backend.used_pages() == 4
        out = np.zeros_like(data)
        assert all(await cache.read(keys, out))
        assert np.array_equal(out, data)
        DeleteFailingFileStore.failing = False
        assert await cache.delete(keys) == 4
        assert d.used("file") == file_tier.backend.used_pages() == 0
        d.check_invariants()
