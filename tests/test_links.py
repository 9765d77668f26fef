"""Links: the reader chosen per (source, destination) medium, the file -> device path that
skips the host bounce, and links accounting the bytes and seconds of each batch."""

from __future__ import annotations

import numpy as np
from cache_kit import PAGE, DeviceReadingStore, config, sequence, stored_below_dram, tier

from kvtier.backend import Medium
from kvtier.cache import KVCache
from kvtier.transfer.links import reader_for, register_link


def _device_config(tmp_path, store: str) -> dict:
    cfg = config(tmp_path)
    cfg["tiers"] = [
        tier("hbm", "cache_kit:DeviceLikeArena", 8),
        tier("file", store, 64, options={"path": str(tmp_path / "file")}),
    ]
    return cfg


async def test_file_to_device_reads_straight_into_the_reserved_slots(tmp_path):
    DeviceReadingStore.targets = []
    rng = np.random.default_rng(50)
    async with KVCache(_device_config(tmp_path, "cache_kit:DeviceReadingStore"), env={}) as cache:
        top = cache.tiers[0]
        assert top.backend.medium is Medium.DEVICE
        tokens, data = sequence(rng, 3)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        await cache.demote("hbm", keys)
        DeviceReadingStore.targets = []
        loaded = await cache.load(keys)
        assert loaded.missing == []
        views = [top.arena.view(s) for s in loaded.slots if s is not None]
        # the store filled the device slots themselves: no host staging buffer
        assert len(DeviceReadingStore.targets) == 3
        assert all(any(np.shares_memory(t, v) for v in views) for t in DeviceReadingStore.targets)
        assert all(np.array_equal(v, d) for v, d in zip(views, data, strict=True))
        cache.release(keys)
        link = cache.metrics.snapshot()["links"]["file->hbm"]
        assert link["pages"] == 3 and link["bytes"] == 3 * PAGE and link["seconds"] > 0


async def test_a_store_that_cannot_read_to_the_device_goes_through_host_staging(tmp_path):
    rng = np.random.default_rng(51)
    async with KVCache(_device_config(tmp_path, "file"), env={}) as cache:
        tokens, data = sequence(rng, 2)
        keys = (await cache.store(tokens, data)).keys
        await cache.flush()
        await cache.demote("hbm", keys)
        loaded = await cache.load(keys)
        top = cache.tiers[0].arena
        views = [top.view(s) for s in loaded.slots if s is not None]
        assert all(np.array_equal(v, d) for v, d in zip(views, data, strict=True))
        cache.release(keys)


async def test_a_registered_reader_serves_its_medium_pair(tmp_path):
    calls: list[int] = []

    async def counting(src, dst, keys, reservations):
        calls.append(len(keys))
        out = [np.empty(dst.page_bytes, dtype=np.uint8) for _ in keys]
        got = await src.get(keys, out)
        return [o if g else None for o, g in zip(out, got, strict=True)]

    rng = np.random.default_rng(52)
    async with KVCache(config(tmp_path), env={}) as cache:
        dram, file_tier = cache.tiers
        before = reader_for(file_tier.backend, dram.backend)
        register_link(Medium.FILE, Medium.HOST, counting)
        try:
            assert reader_for(file_tier.backend, dram.backend) is counting
            keys = await stored_below_dram(cache, rng, 2)
            assert (await cache.load(keys)).missing == []
            assert calls == [2]  # one call for the batch
            cache.release(keys)
        finally:
            register_link(Medium.FILE, Medium.HOST, before)
