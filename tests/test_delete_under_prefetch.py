"""A delete removes pages that copies under way bring back: once ``delete`` returns, no
tier holds them.

A prefetch copy from the file tier to DRAM that began before delete's pass reached the
file tier landed in DRAM after the pass had left DRAM behind: a docs-only probe read 46
of 912 deleted sequences back after ``delete`` had answered (the deleted pages' own
bytes, still there 20 ms later). Now delete goes over the tiers again until none holds
the pages.

Real DRAM over a real file store, the tiny model; tasks each own their sequences.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
from cache_kit import PAGE, PT, open_cache, tier

from kvtier.cache import KVCache


def _config(tmp_path: Path, policy: str) -> dict:
    return {
        "model": {"preset": "tiny"},
        "log": {"level": "critical"},
        "pipeline": {"write_policy": policy, "batch_pages": 2},
        "tiers": [
            tier("dram", "dram", 12),
            tier("disk", "file", 256, options={"path": str(tmp_path / "disk")}),
        ],
    }


async def _worker(cache: KVCache, w: int, seconds: float, found: list[str]) -> int:
    rng = np.random.default_rng(w)
    end = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < end:
        rounds += 1
        pages = int(rng.choice([2, 4, 6]))
        tokens = np.arange(pages * PT) + 1_000_000 * w + 1_000 * rounds
        data = rng.integers(0, 256, size=(pages, PAGE), dtype=np.uint8)
        keys = (await cache.store(tokens, data)).keys
        await cache.prefetch(keys, 0.0)
        await cache.delete(keys)
        out = np.zeros_like(data)
        hits = await cache.read(keys, out)
        if any(hits):
            found.append(f"worker {w} round {rounds}: read after delete answered {hits}")
        await asyncio.sleep(0)
    return rounds


@pytest.mark.parametrize("policy", ["write-through", "write-back"])
async def test_no_page_is_read_back_after_its_delete(tmp_path: Path, policy: str) -> None:
    found: list[str] = []
    async with open_cache(_config(tmp_path, policy)) as cache:
        rounds = await asyncio.gather(*(_worker(cache, w, 2.0, found) for w in range(6)))
        await cache.pipeline.drain()
        assert sum(rounds) > 50
        assert found == []
        for t in cache.tiers:
            assert cache.directory.used(t.name) == t.backend.used_pages(), t.name
