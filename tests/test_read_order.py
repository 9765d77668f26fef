"""A read whose pages sit in two tiers reads the top tier's first.

Before, the groups were read in the order of the first key of each: a prompt's older
pages (below) before its newer ones (on top). While the slow group was read, concurrent
stores evicted the top tier's pages of the read down to the slow tier, so the read found
them gone and went back to the slow tier for a second ``get``: the read took twice the
slow tier's latency (0.5 s -> 1.0 s in ``benchmarks/vllm_async_loads.py``'s set-up).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
from fault_stores import SlowGetStore

from kvtier.cache import KVCache


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
