"""Hit and miss counts follow what served a page, not where it was found.

A page the directory places in a tier but whose read there fails (a damaged file, a
tier that stopped answering) used to count as a hit in that tier before the read: a
fault-injection run saw 40 file-tier hits for 0 good reads. Now a read or load counts a
hit in the tier its bytes came from and a miss in every tier above; a page no tier
served is a miss everywhere (and its failure is counted in ``failed_pages``).

Real DRAM over a real file store, the tiny model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from cache_kit import config, damage_on_disk, open_cache, sequence_below_dram

from kvtier.cache import KVCache


def _counts(cache: KVCache) -> dict[str, tuple[int, int, int]]:
    snap = cache.metrics.snapshot()["tiers"]
    return {
        t.name: (snap[t.name]["hits"], snap[t.name]["misses"], snap[t.name]["failed_pages"])
        for t in cache.tiers
    }


async def _on_disk_one_damaged(cache: KVCache, rng: np.random.Generator):
    keys, data = await sequence_below_dram(cache, rng, 3)
    damage_on_disk(cache, keys[0])
    return keys, data


async def test_a_read_counts_a_damaged_page_as_a_miss(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    async with open_cache(config(tmp_path, dram_pages=8)) as cache:
        keys, data = await _on_disk_one_damaged(cache, rng)
        before = _counts(cache)
        out = np.zeros_like(data)
        assert await cache.read(keys, out) == [False, True, True]
        after = _counts(cache)
        dram = tuple(a - b for a, b in zip(after["dram"], before["dram"], strict=True))
        disk = tuple(a - b for a, b in zip(after["file"], before["file"], strict=True))
        assert dram == (0, 3, 0)  # three pages asked, none in DRAM
        assert disk == (2, 1, 1)  # two served from disk; the damaged one failed there


async def test_a_load_counts_hits_where_the_bytes_came_from(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    async with open_cache(config(tmp_path, dram_pages=8)) as cache:
        keys, _ = await _on_disk_one_damaged(cache, rng)
        before = _counts(cache)
        loaded = await cache.load(keys, pin=False)
        assert loaded.missing == [keys[0]]
        after = _counts(cache)
        assert after["dram"][:2] == (before["dram"][0], before["dram"][1] + 3)
        assert after["file"] == (
            before["file"][0] + 2,
            before["file"][1] + 1,
            before["file"][2] + 1,
        )

        again = _counts(cache)  # the two good pages are in DRAM now: hits there
        assert (await cache.load(keys, pin=False)).missing == [keys[0]]
        now = _counts(cache)
        assert now["dram"][:2] == (again["dram"][0] + 2, again["dram"][1] + 1)
        assert now["file"][:2] == (again["file"][0], again["file"][1] + 1)
