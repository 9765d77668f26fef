"""Room in a tier: first come, first served; the background evictor lets a batch land
without waiting for the write-down of its victims; a pinned-full tier still raises."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import numpy as np
import pytest
from cache_kit import GatedDeleteFileStore, GatedFileStore, config, open_cache, sequence, tier

from kvtier.cache import KVCache
from kvtier.config.defaults import DEFAULT_EVICTION
from kvtier.errors import CapacityError
from kvtier.index.directory import PageState
from kvtier.policy.eviction import EVICTION_POLICIES
from kvtier.sequences import SequenceManager


def _gated(tmp_path, dram_pages: int, background: bool, **extra) -> dict:
    return config(
        tmp_path,
        dram_pages=dram_pages,
        file_backend="cache_kit:GatedFileStore",
        write_policy="write-back",
        background_eviction=background,
        **extra,
    )


async def _stored_whole(cache: KVCache, rng: np.random.Generator, pages: int) -> None:
    """Store a random sequence of ``pages`` pages: every page is stored and reads back."""
    tokens, data = sequence(rng, pages)
    assert all((await cache.store(tokens, data)).stored)
    out = np.zeros_like(data)
    assert all(await cache.read(cache.page_keys(tokens), out))
    assert np.array_equal(out, data)


async def _until(cond, what: str) -> None:
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"timed out waiting until {what}")


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
async def test_room_is_served_first_come_first_served(tmp_path, background):
    """A caller that needs an eviction comes first; a later caller whose page would fit
    at once must wait behind it instead of taking the room it is making."""
    GatedFileStore.gate = None
    rng = np.random.default_rng(40)
    cfg = _gated(tmp_path, 4, background)
    cfg["tiers"][0].update(high_watermark=1.0, low_watermark=1.0)
    async with KVCache(cfg, env={}) as cache:
        tokens, data = sequence(rng, 3)
        await cache.store(tokens, data)  # 3 of 4 pages used
        GatedFileStore.gate = asyncio.Event()  # write-downs wait from now on
        done: list[str] = []

        async def store(name: str, pages: int) -> None:
            t, d = sequence(rng, pages)
            await cache.store(t, d)
            done.append(name)

        first = asyncio.create_task(store("first", 2))  # needs a victim written down
        await _until(lambda: GatedFileStore.held > 0, "the first caller's write-down waits")
        second = asyncio.create_task(store("second", 1))  # would fit in the free page
        await asyncio.sleep(0.05)
        assert done == []  # the second caller did not overtake the first
        assert cache.pipeline.room.waiting(cache.tiers[0]) == 2
        GatedFileStore.gate.set()
        await asyncio.gather(first, second)
        assert done == ["first", "second"]
        GatedFileStore.gate = None


async def test_background_evictor_lets_a_batch_land_before_its_victims_are_written(tmp_path):
    GatedFileStore.gate = None
    rng = np.random.default_rng(41)
    async with KVCache(_gated(tmp_path, 10, True), env={}) as cache:
        top = cache.tiers[0]  # high watermark 8, low 7
        tokens, data = sequence(rng, 8)
        await cache.store(tokens, data)
        GatedFileStore.gate = asyncio.Event()
        more, more_data = sequence(rng, 2)
        result = await asyncio.wait_for(cache.store(more, more_data), 10)  # not held back
        assert all(result.stored)
        d = cache.directory
        assert top.high_pages < d.used("dram") <= top.capacity_pages
        assert d.evicting("dram") > 0 and GatedFileStore.held > 0  # written down meanwhile
        GatedFileStore.gate.set()
        await cache.pipeline.drain()
        assert d.used("dram") <= top.low_pages
        out = np.zeros((8, data.shape[1]), dtype=np.uint8)
        assert all(await cache.read(cache.page_keys(tokens), out))
        assert np.array_equal(out, data)
        GatedFileStore.gate = None


async def test_without_the_background_evictor_a_batch_waits_for_its_victims(tmp_path):
    GatedFileStore.gate = None
    rng = np.random.default_rng(42)
    async with KVCache(_gated(tmp_path, 10, False), env={}) as cache:
        tokens, data = sequence(rng, 8)
        await cache.store(tokens, data)
        GatedFileStore.gate = asyncio.Event()
        more, more_data = sequence(rng, 2)
        task = asyncio.create_task(cache.store(more, more_data))
        await _until(lambda: GatedFileStore.held > 0, "the write-down waits")
        await asyncio.sleep(0.05)
        assert not task.done()  # the store waits for its victims to go down
        GatedFileStore.gate.set()
        assert all((await task).stored)
        assert cache.directory.used("dram") <= cache.tiers[0].high_pages
        GatedFileStore.gate = None


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
async def test_a_pinned_full_tier_still_raises_for_every_waiter(tmp_path, background):
    rng = np.random.default_rng(43)
    cfg = config(tmp_path, dram_pages=4, background_eviction=background)
    async with KVCache(cfg, env={}) as cache:
        tokens, data = sequence(rng, 4)
        keys = (await cache.store(tokens, data)).keys
        await cache.load(keys)  # all four pinned
        calls = [cache.store(*sequence(rng, 1)) for _ in range(3)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, CapacityError) for r in results)
        cache.release(keys)
        assert all((await cache.store(*sequence(rng, 1))).stored)


async def test_a_load_keeps_a_page_the_evict_queue_is_writing_down(tmp_path):
    """A page being written down in the background is still readable: a lookup finds it
    in the top tier, a load pins it there without waiting for the write-down, and the
    eviction then leaves it where it is instead of dropping it from the top tier."""
    GatedFileStore.gate = None
    rng = np.random.default_rng(44)
    async with KVCache(_gated(tmp_path, 10, True), env={}) as cache:
        tokens, data = sequence(rng, 3)
        keys = (await cache.store(tokens, data)).keys
        GatedFileStore.gate = asyncio.Event()
        demoting = asyncio.create_task(cache.demote("dram", keys))
        await _until(lambda: GatedFileStore.held > 0, "the write-down waits")
        assert cache.directory.evicting("dram") == 3
        found = await cache.lookup(tokens)
        assert found.keys == keys and found.tiers == ["dram"] * 3
        hits = cache.metrics.snapshot()["tiers"]["dram"]["hits"]
        loaded = await asyncio.wait_for(cache.load(keys), 5)  # the write-down still waits
        assert GatedFileStore.held > 0 and not demoting.done()
        assert cache.metrics.snapshot()["tiers"]["dram"]["hits"] == hits + 3
        GatedFileStore.gate.set()
        assert sorted(await demoting) == sorted(keys)  # they stay: pinned meanwhile
        assert loaded.missing == [] and all(cache.directory.is_committed(k, "dram") for k in keys)
        assert all(cache.directory.is_committed(k, "file") for k in keys)  # and went down
        top = cache.tiers[0].arena
        assert all(np.array_equal(top.view(s), d) for s, d in zip(loaded.slots, data, strict=True))
        cache.release(keys)
        GatedFileStore.gate = None


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
    async with open_cache(cfg) as cache:
        tokens, data = sequence(rng, 8)
        keys = (await cache.store(tokens, data)).keys
        await cache.load(keys[-1:])  # the chain's leaf only
        more, more_data = sequence(rng, 4)
        with pytest.raises(
            CapacityError,
            match=r"1 of its 10 pages are pinned or reserved; none of the other 7 can go "
            rf"\(its eviction policy \(leaf-first\({re.escape(DEFAULT_EVICTION)}\)\) offers none",
        ):
            await cache.store(more, more_data)
        cache.release(keys[-1:])
        assert all((await cache.store(more, more_data)).stored)


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
async def test_concurrent_stores_on_a_tiny_tier_all_land(tmp_path, background):
    """Several callers store multi-page sequences at once on a 4-page top tier (as a
    serving engine saves its requests' pages): victims the policy keeps after all (a
    child landed meanwhile) are not a failure, so every store lands, and every page is
    found and read back afterwards."""
    rng = np.random.default_rng(45)
    cfg = config(tmp_path, dram_pages=4, file_pages=1024, background_eviction=background)
    stored: list[tuple[np.ndarray, np.ndarray]] = []
    async with KVCache(cfg, env={}) as cache:
        for _round in range(10):
            batch = [sequence(rng, int(rng.integers(1, 9))) for _ in range(8)]
            results = await asyncio.gather(*(cache.store(t, d) for t, d in batch))
            for (t, d), r in zip(batch, results, strict=True):
                assert all(r.stored), f"a store of {len(d)} pages landed {sum(r.stored)}"
                stored.append((t, d))
        for t, d in stored:
            found = await cache.lookup(t)
            assert len(found.keys) == len(d)
            out = np.empty_like(d)
            assert all(await cache.read(found.keys, out))
            np.testing.assert_array_equal(out, d)


async def test_a_page_that_stays_is_free_while_the_rest_of_its_eviction_finishes(tmp_path):
    """An eviction whose victim was pinned meanwhile keeps that page; the page is an
    ordinary committed page again at once, not when the other victims' deletes are done.
    (It used to keep its eviction open until then: a load of it waited for an unrelated
    delete, and a room-maker naming it a victim meanwhile left a fetch waiting forever.)"""
    GatedFileStore.gate = GatedDeleteFileStore.gate = None
    rng = np.random.default_rng(44)
    below = tier("below", "cache_kit:GatedFileStore", 64, options={"path": str(tmp_path / "b")})
    cfg = config(
        tmp_path,
        8,
        64,
        file_backend="cache_kit:GatedDeleteFileStore",
        extra_tiers=[below],
        write_policy="write-back",
    )
    async with open_cache(cfg) as cache:
        try:
            (t1, d1), (t2, d2) = sequence(rng, 1), sequence(rng, 1)  # unrelated pages
            k1, k2 = keys = [(await cache.store(t, d)).keys[0] for t, d in ((t1, d1), (t2, d2))]
            await cache.flush()
            await cache.demote("dram", keys)  # held by "file" alone
            GatedFileStore.gate = asyncio.Event()  # the write-down to "below" waits
            demoting = asyncio.create_task(cache.demote("file", keys))
            await _until(lambda: GatedFileStore.held > 0, "the write-down waits")
            loading = asyncio.create_task(cache.load([k2]))  # pins k2: it will stay
            await asyncio.sleep(0.02)
            GatedDeleteFileStore.gate = asyncio.Event()  # then k1's delete from "file" waits
            GatedFileStore.gate.set()
            await _until(lambda: GatedDeleteFileStore.held > 0, "k1's delete waits")
            loaded = await asyncio.wait_for(loading, 5)  # not held up by k1's delete
            assert loaded.missing == []
            assert cache.directory.state(k2, "file") is PageState.COMMITTED
            cache.release([k2])
            GatedDeleteFileStore.gate.set()
            assert await asyncio.wait_for(demoting, 5) == [k2]  # k2 stayed, k1 went down
            assert cache.directory.state(k1, "file") is None
            assert [(await cache.lookup(t)).tiers for t in (t1, t2)] == [["below"], ["dram"]]
            out = np.zeros((2, d1.shape[1]), dtype=np.uint8)
            assert all(await cache.read(keys, out))
            assert np.array_equal(out, np.concatenate([d1, d2]))
        finally:  # a failed check must not leave the cache's close waiting at a gate
            for gate in (GatedFileStore.gate, GatedDeleteFileStore.gate):
                if gate is not None:
                    gate.set()
    GatedFileStore.gate = GatedDeleteFileStore.gate = None


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
async def test_a_sequence_longer_than_the_top_tier_is_stored_under_every_policy(
    tmp_path, policy, background
):
    """12 pages through a 4-page DRAM tier in batches of 4: the batches' parents are
    spared (leaf-first policies), so room comes from moving ancestors down. Under
    prefix-lru it used to raise CapacityError: its own order reaches no ancestor of a
    spared leaf."""
    rng = np.random.default_rng(45)
    cfg = config(tmp_path, 4, 256, batch_pages=4, background_eviction=background)
    for t in cfg["tiers"]:
        t["eviction"] = policy
    async with open_cache(cfg) as cache:
        await _stored_whole(cache, rng, 12)


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
async def test_a_top_tier_with_high_watermark_1_takes_a_sequence_twice_its_size(
    tmp_path, background
):
    """4 DRAM pages with ``high_watermark = 1`` and ``batch_pages`` 8: batches were of 4
    pages, the whole tier, but room for a batch spares the page it extends, so the second
    batch raised CapacityError. Under leaf-first a batch now leaves that page room."""
    rng = np.random.default_rng(46)
    cfg = config(tmp_path, 4, 64, batch_pages=8, background_eviction=background)
    cfg["tiers"][0].update(high_watermark=1.0, low_watermark=1.0)
    async with open_cache(cfg) as cache:
        await _stored_whole(cache, rng, 10)


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
@pytest.mark.parametrize("hold", ["pins", "working-pool"])
async def test_a_store_beside_held_pages_is_cut_to_the_room_they_leave(tmp_path, hold, background):
    """24 DRAM pages, 10 of them held (pinned by a load, or an engine's working pool),
    and a store of 40 pages with ``batch_pages`` 32: batches were cut to the high
    watermark alone (19 pages), which could not fit beside the 10 held, so the whole
    store raised CapacityError and kept nothing, though 14 pages were free and the
    file tier below had room. Batches are now cut to the room the held pages leave."""
    rng = np.random.default_rng(47)
    cfg = config(tmp_path, 24, 256, background_eviction=background)
    async with open_cache(cfg) as cache:
        if hold == "pins":
            held_tokens, held_data = sequence(rng, 10)
            held = (await cache.store(held_tokens, held_data)).keys
            await cache.load(held)
            manager = None
        else:
            manager = await SequenceManager.open(cache, 10)
        assert cache.pipeline.room.held(cache.tiers[0]) == 10
        await _stored_whole(cache, rng, 40)
        if manager is None:
            out = np.zeros_like(held_data)
            assert all(await cache.read(held, out))  # the pinned pages stayed
            assert np.array_equal(out, held_data)
            cache.release(held)
        else:
            await manager.close()
