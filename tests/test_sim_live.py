"""The replay and the live pipeline agree: same trace, same policy, same hits."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.cache import KVCache
from kvtier.keys import ROOT_KEY
from kvtier.policy.eviction import make_policy
from kvtier.sim.replay import SimTier, replay
from kvtier.sim.trace import key_block
from kvtier.sim.workloads import workload


@pytest.mark.parametrize("policy", ["lru", "prefix-lru", "density", "lru-k", "adaptive"])
async def test_replay_matches_live_cache_hits(tmp_path, policy: str) -> None:
    import kvtier.policy  # noqa: F401 - registers policies for config

    trace = workload("chat", n=150, seed=7, block_tokens=4)
    spec_page_tokens = 4  # the "tiny" preset
    cfg = {
        "model": {"preset": "tiny"},
        # The replay drives the bare policy; live leaf-first wrapping would reorder victims.
        "pipeline": {"leaf_first": False},
        "tiers": [
            {
                "name": "dram",
                "backend": "dram",
                "capacity": 40 * 512,
                "high_watermark": 1.0,
                "low_watermark": 1.0,
                "eviction": policy,
            }
        ],
    }
    live_hits: list[int] = []
    async with KVCache(cfg, env={}, configure_log=False) as cache:
        capacity = cache.tiers[0].capacity_pages
        page_bytes = cache.spec.page_bytes
        for req in trace.requests:
            ids = [key_block(k) for k in req.blocks]
            tokens = np.repeat(np.asarray(ids, dtype=np.uint32), spec_page_tokens)
            found = await cache.lookup(tokens)
            keys = cache.page_keys(tokens)
            hits = len(found.keys)
            live_hits.append(hits)
            await cache.load(keys[:hits], pin=True)
            # as an engine does: store only what it computed, past the cached prefix
            parent = keys[hits - 1] if hits else ROOT_KEY
            rest = tokens[hits * spec_page_tokens :]
            await cache.store(
                rest, np.zeros((len(keys) - hits, page_bytes), dtype=np.uint8), parent=parent
            )
            cache.release(keys[:hits])
    sim = replay(trace, [SimTier("dram", capacity, make_policy(policy))])
    assert sim.req_hits[:, 0].tolist() == live_hits
    assert sum(live_hits) > 0  # the trace does exercise hits
    assert trace.distinct_blocks() > 2 * capacity  # ... and evictions
