"""The replay and the live pipeline agree, request by request: both drive the one planner.

An engine's requests run one after the other against a live :class:`KVCache` (lookup,
load the cached prefix pinned, store what it computed, let background work finish,
release) and through :func:`kvtier.sim.replay.replay` with the same policies; the tier
that served each page of each request's prefix must be the same. Every registered
eviction policy, with and without the background evictor, one tier and two tiers, every
write policy.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

import kvtier.policy  # noqa: F401 - registers every policy
from kvtier.cache import KVCache
from kvtier.keys import ROOT_KEY
from kvtier.policy.admission import make_admission
from kvtier.policy.eviction import EVICTION_POLICIES, make_policy
from kvtier.sim.replay import SimTier, replay
from kvtier.sim.trace import Trace, key_block
from kvtier.sim.workloads import workload

PAGE_TOKENS = 4  # the "tiny" preset
PAGE_BYTES = 512
POLICIES = sorted(EVICTION_POLICIES)


async def _live_hits(trace: Trace, cfg: dict[str, Any]) -> list[list[int]]:
    """Per request, the prefix hits each tier served in a live cache."""
    out: list[list[int]] = []
    async with KVCache(cfg, env={}, configure_log=False) as cache:
        names = [t.name for t in cache.tiers]
        for req in trace.requests:
            ids = [key_block(k) for k in req.blocks]
            tokens = np.repeat(np.asarray(ids, dtype=np.uint32), PAGE_TOKENS)
            found = await cache.lookup(tokens)
            keys = cache.page_keys(tokens)
            hits = len(found.keys)
            per_tier = Counter(found.tiers)
            out.append([per_tier.get(n, 0) for n in names])
            await cache.load(keys[:hits], pin=True)
            # as an engine does: store only what it computed, past the cached prefix
            parent = keys[hits - 1] if hits else ROOT_KEY
            rest = tokens[hits * PAGE_TOKENS :]
            pages = np.zeros((len(keys) - hits, PAGE_BYTES), dtype=np.uint8)
            await cache.store(rest, pages, parent=parent)
            await cache.pipeline.drain()  # write-through and the evict queue have run
            cache.release(keys[:hits])
    return out


#: Parameters that keep a policy off the clock. ``adaptive`` starts on its ``interval``
#: expert, which forecasts by time: the live cache's clock is ``time.monotonic()`` (a
#: request here takes milliseconds) and the replay's the trace's timestamps, so the two
#: could only agree by chance. Without ``interval`` the decisions do not depend on time.
CLOCK_FREE: dict[str, dict[str, Any]] = {"adaptive": {"experts": ["s3-fifo"]}}


def _tier(name: str, backend: str, pages: int, policy: str, wm: tuple[float, float]) -> dict:
    return {
        "name": name,
        "backend": backend,
        "capacity": pages * PAGE_BYTES,
        "high_watermark": wm[0],
        "low_watermark": wm[1],
        "eviction": policy,
        "eviction_params": CLOCK_FREE.get(policy, {}),
    }


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
@pytest.mark.parametrize("policy", POLICIES)
async def test_replay_matches_live_cache_hits(policy: str, background: bool) -> None:
    trace = workload("chat", n=150, seed=7, block_tokens=PAGE_TOKENS)
    capacity = 40
    cfg = {
        "model": {"preset": "tiny"},
        # The replay drives the bare policy; live leaf-first wrapping would reorder victims.
        "pipeline": {"leaf_first": False, "background_eviction": background},
        "tiers": [_tier("dram", "dram", capacity, policy, (1.0, 1.0))],
    }
    live = await _live_hits(trace, cfg)
    sim = replay(
        trace, [SimTier("dram", capacity, make_policy(policy, **CLOCK_FREE.get(policy, {})))]
    )
    assert sim.req_hits.tolist() == live
    assert sum(h[0] for h in live) > 0  # the trace does exercise hits
    assert trace.distinct_blocks() > 2 * capacity  # ... and evictions


@pytest.mark.parametrize(
    ("write_policy", "policy", "background", "watermarks"),
    [
        ("write-back", "lru", False, (0.8, 0.6)),
        ("write-back", "arc", False, (0.8, 0.6)),
        ("write-back", "s3-fifo", True, (1.0, 1.0)),
        ("write-back", "adaptive", False, (0.8, 0.6)),
        ("write-back", "lru-k", True, (1.0, 1.0)),
        ("write-through", "adaptive", True, (1.0, 1.0)),
        ("write-through", "lru", False, (0.8, 0.6)),
        ("write-through", "session", True, (1.0, 1.0)),
        ("selective", "lru-k", False, (0.8, 0.6)),
        ("selective", "prefix-lru", True, (1.0, 1.0)),
    ],
)
async def test_replay_matches_live_cache_on_two_tiers(
    tmp_path, write_policy: str, policy: str, background: bool, watermarks: tuple[float, float]
) -> None:
    """DRAM over a file tier: fetches from below, victims written down or dropped, pages
    written through, the admission policy of ``selective``; per tier, the same hits."""
    trace = workload("chat", n=150, seed=11, block_tokens=PAGE_TOKENS)
    dram, disk = 24, 60
    lower = _tier("file", "file", disk, "lru", watermarks)
    lower["options"] = {"path": str(tmp_path / "file")}
    cfg = {
        "model": {"preset": "tiny"},
        "pipeline": {
            "leaf_first": False,
            "background_eviction": background,
            "write_policy": write_policy,
            "admission": "reuse" if write_policy == "selective" else "all",
            "batch_pages": 64,  # one batch per call: the replay runs a call's batches in order
        },
        "tiers": [_tier("dram", "dram", dram, policy, watermarks), lower],
    }
    live = await _live_hits(trace, cfg)
    hi, lo = watermarks
    sim = replay(
        trace,
        [
            SimTier(
                "dram",
                dram,
                make_policy(policy, **CLOCK_FREE.get(policy, {})),
                high_watermark=hi,
                low_watermark=lo,
            ),
            SimTier("file", disk, make_policy("lru"), high_watermark=hi, low_watermark=lo),
        ],
        write_policy,
        admission=make_admission("reuse" if write_policy == "selective" else "all"),
        batch_pages=64,
    )
    assert sim.req_hits.tolist() == live
    assert sum(h[1] for h in live) > 0  # pages do come back from the lower tier
