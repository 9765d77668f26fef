"""What-if sizing: miniature hierarchies against real replays at the same capacities, and
the live cache's ``stats()`` / Prometheus exposure."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import kvtier.policy  # noqa: F401 - registers policies
from kvtier.cache import KVCache
from kvtier.errors import KVTierUsageError
from kvtier.keys import ROOT_KEY
from kvtier.policy.eviction import make_policy
from kvtier.policy.shadow import key_hash
from kvtier.sim.replay import make_tiers, replay
from kvtier.sim.trace import Trace
from kvtier.sim.whatif import FACTORS, SAMPLE_SEED, TierModel, WhatIf, factor_label
from kvtier.sim.workloads import workload


def _feed(w: WhatIf, tr: Trace) -> None:
    """The trace's requests, each after its time (as the replay and the live cache give
    the clock to policies that keep time, such as ``adaptive``'s ``interval``)."""
    for r in tr.requests:
        w.on_time(r.timestamp_s)
        w.on_request(r.blocks)


def _replayed(tr: Trace, caps: list[int], policy: str, write_policy: str = "write-back") -> float:
    res = replay(tr, make_tiers(caps, functools.partial(make_policy, policy)), write_policy)  # type: ignore[arg-type]
    return res.prefix_hit_rate


def test_factor_labels() -> None:
    assert [factor_label(f) for f in (0.5, 0.75, 1.0, 1.25, 2.0)] == [
        "-50%",
        "-25%",
        "+0%",
        "+25%",
        "+100%",
    ]


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_unsampled_estimates_are_replays(policy: str) -> None:
    tr = workload("chat", n=500, seed=3).without_hints()
    cap = tr.distinct_blocks() // 20
    model = TierModel("hbm", cap, functools.partial(make_policy, policy))
    w = WhatIf([model], mini_pages=1 << 20)  # rate 1: no sampling
    _feed(w, tr)
    est = w.estimates()["hbm"]
    assert est["sample_rate"] == 1.0
    for f in (1.0, *FACTORS):
        want = _replayed(tr, [max(round(cap * f), 1)], policy)
        assert est["hit_rate"][factor_label(f)] == pytest.approx(want, abs=1e-12)


def test_two_tiers_estimate_the_cumulative_hit_rate() -> None:
    tr = workload("zipf", n=800, seed=4).without_hints()
    cap = tr.distinct_blocks() // 40
    models = [
        TierModel("hbm", cap, functools.partial(make_policy, "lru")),
        TierModel("dram", 3 * cap, functools.partial(make_policy, "lru")),
    ]
    w = WhatIf(models, "write-back", mini_pages=1 << 20)
    _feed(w, tr)
    est = w.estimates()
    assert est["hbm"]["hit_rate"]["+0%"] == pytest.approx(_replayed(tr, [cap], "lru"))
    # the second tier: both tiers together, the second at 2x
    res = replay(tr, make_tiers([cap, 6 * cap], functools.partial(make_policy, "lru")))
    assert est["dram"]["hit_rate"]["+100%"] == pytest.approx(res.prefix_hit_rate)


@pytest.mark.parametrize("name", ["chat", "tenants", "rag", "zipf"])
def test_sampled_estimates_within_0_02_of_replays(name: str) -> None:
    tr = workload(name, n=3000, seed=8).without_hints()
    cap = tr.distinct_blocks() // 10
    model = TierModel("hbm", cap, functools.partial(make_policy, "lru"))
    # forces sampling at rate 1/2 (miniatures half the real sizes, ~200 to 2,000 pages);
    # much smaller miniatures (a couple of hundred pages at 2x) err by up to 0.03
    w = WhatIf([model], mini_pages=max(cap // 2, 16))
    _feed(w, tr)
    est = w.estimates()["hbm"]
    assert est["sample_rate"] <= 0.5
    for f in (1.0, *FACTORS):
        want = _replayed(tr, [max(round(cap * f), 1)], "lru")
        assert abs(est["hit_rate"][factor_label(f)] - want) <= 0.02, (f, want)


def test_whatif_bad_input() -> None:
    m = TierModel("hbm", 10, functools.partial(make_policy, "lru"))
    with pytest.raises(KVTierUsageError, match="no tiers"):
        WhatIf([])
    with pytest.raises(KVTierUsageError, match="write policy"):
        WhatIf([m], "write-sideways")
    with pytest.raises(KVTierUsageError, match="factors"):
        WhatIf([m], factors=[0.0])
    with pytest.raises(KVTierUsageError, match="capacity"):
        WhatIf([TierModel("x", 0, m.policy)])


@pytest.mark.parametrize(
    ("factors", "match"),
    [
        (None, "list of numbers"),
        ("2", "list of numbers"),
        ([True], "numbers, got True"),
        (["2"], "numbers, got '2'"),
        ([float("nan")], "finite"),
        ([float("inf")], "finite"),
        ([1e308], "<= 1000"),
        ([-0.5], "> 0"),
        ([1.004], "label '\\+0%' of the current size"),
        ([0.5, 0.504], "label '-50%' of 0.5"),
    ],
)
def test_whatif_bad_factors_are_named(factors: object, match: str) -> None:
    m = TierModel("hbm", 10, functools.partial(make_policy, "lru"))
    with pytest.raises(KVTierUsageError, match=match):
        WhatIf([m], factors=factors)  # type: ignore[arg-type]


def test_whatif_takes_numpy_numbers() -> None:
    m = TierModel("hbm", 10, functools.partial(make_policy, "lru"))
    w = WhatIf([m], factors=[np.int64(2), np.float64(0.5)], mini_pages=np.int64(64))  # type: ignore[arg-type]
    assert w.factors == [0.5, 1.0, 2.0]
    assert w.mini_pages == 64 and type(w.mini_pages) is int


def test_no_estimate_before_a_sampled_reference() -> None:
    """A sampled tier reports no estimate (not 100 %) until a page of its sample is
    looked up: SHARDS' adjustment alone would count every expected reference a hit."""
    m = TierModel("dram", 1 << 17, functools.partial(make_policy, "lru"))
    w = WhatIf([m], mini_pages=16)
    assert w.groups[0].rate < 1e-3
    keys = [bytes([i % 256, i // 256]) * 8 for i in range(48)]
    hashes_kept = [k for k in keys if w.groups[0].keeps(key_hash(k, SAMPLE_SEED))]
    assert not hashes_kept  # none of these is in the sample
    for i in range(0, 48, 4):
        w.on_request(keys[i : i + 4])
    est = w.estimates()["dram"]
    assert est["sampled_refs"] == 0
    assert set(est["hit_rate"].values()) == {None}


async def test_live_cache_reports_whatif_in_stats_and_prometheus() -> None:
    cfg = {
        "model": {"preset": "tiny"},
        "pipeline": {"leaf_first": False},  # the replay drives the bare policy
        "tiers": [
            {
                "name": "dram",
                "backend": "dram",
                "capacity": 64 * 512,
                "high_watermark": 1.0,
                "low_watermark": 1.0,
            }
        ],
    }
    tr = workload("chat", n=120, seed=2, block_tokens=4)
    async with KVCache(cfg, env={}, configure_log=False, whatif=True) as cache:
        for req in tr.requests:
            tokens = np.repeat(np.asarray([int.from_bytes(b, "little") for b in req.blocks]), 4)
            found = await cache.lookup(tokens)
            keys = cache.page_keys(tokens)
            n = len(found.keys)
            await cache.load(keys[:n], pin=True)  # as an engine does
            rest = np.zeros((len(keys) - n, cache.spec.page_bytes), dtype=np.uint8)
            await cache.store(tokens[n * 4 :], rest, parent=keys[n - 1] if n else ROOT_KEY)
            cache.release(keys[:n])
        stats = cache.stats()
        wi = stats["whatif"]
        assert wi["lookups"] == len(tr.requests)
        dram = wi["tiers"]["dram"]
        assert set(dram["hit_rate"]) == {"-50%", "-25%", "+0%", "+25%", "+50%", "+100%"}
        # unsampled, same policy, same requests: the estimate at its own size is exact
        assert dram["hit_rate"]["+0%"] == pytest.approx(dram["measured_hit_rate"], abs=1e-9)
        assert dram["hit_rate"]["-50%"] <= dram["hit_rate"]["+100%"]
        prom = cache.metrics.to_prometheus()
        assert 'kvtier_whatif_hit_rate{tier="dram",capacity="+100%"}' in prom


async def test_a_scrape_sees_the_whatif_estimates_of_every_lookup_so_far() -> None:
    """The gauges are refreshed when the metrics are read (a Prometheus scrape), not only
    every ``publish_every`` lookups: an engine that scrapes after 10 lookups, or whose
    traffic is low, sees estimates (before, none until the 64th lookup)."""
    cfg = {"model": {"preset": "tiny"}, "tiers": [{"name": "dram", "backend": "dram",
                                                    "capacity": 64 * 512}]}  # fmt: skip
    async with KVCache(cfg, env={}, configure_log=False, whatif=True) as cache:
        for i in range(10):
            await cache.lookup(np.arange(4 * cache.spec.page_tokens) + 1000 * (i % 3))
        text = cache.metrics.to_prometheus()
        line = next(s for s in text.splitlines() if s.startswith("kvtier_whatif_measured"))
        # 10 lookups of 4 pages, nothing stored: nothing found
        assert line == 'kvtier_whatif_measured_hit_rate{tier="dram"} 0', text
        assert 'kvtier_whatif_hit_rate{tier="dram",capacity="+100%"}' in text
        observer = next(o for o in cache.hooks.observers if o.name == "whatif")
        observer.stop_refreshing()  # type: ignore[attr-defined]
        pages = rng_pages(4, cache.spec.page_bytes)
        await cache.store(np.arange(4 * cache.spec.page_tokens), pages)
        await cache.lookup(np.arange(4 * cache.spec.page_tokens))  # 4 pages found
        assert whatif_lines(cache.metrics.to_prometheus()) == whatif_lines(text)  # not refreshed
        observer.publish()  # type: ignore[attr-defined]
        refreshed = cache.metrics.to_prometheus()
        assert 'kvtier_whatif_measured_hit_rate{tier="dram"} 0.0909' in refreshed  # 4 of 44


def whatif_lines(text: str) -> list[str]:
    return [s for s in text.splitlines() if s.startswith("kvtier_whatif")]


def rng_pages(n: int, page_bytes: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, (n, page_bytes), dtype=np.uint8)
