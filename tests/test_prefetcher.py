"""The live prefetch predictor: prefetches with deadlines inside a running cache, counted
useful or wasted; and ``bench run`` with and without it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtier.cli.app import get_app
from typer.testing import CliRunner

from kvtier.cache import KVCache
from kvtier.errors import KVTierUsageError
from kvtier.prefetcher import LivePrefetcher

PAGE_TOKENS = 4  # the "tiny" preset


def _cfg(tmp_path: Path, top_pages: int = 8) -> dict[str, Any]:
    return {
        "model": {"preset": "tiny"},
        "pipeline": {"write_policy": "write-through"},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": top_pages * 512},
            {
                "name": "disk",
                "backend": "file",
                "capacity": 256 * 512,
                "options": {"path": str(tmp_path / "disk")},
            },
        ],
    }


def _tokens(seq: int, pages: int) -> np.ndarray:
    return np.arange(seq * 1000, seq * 1000 + pages * PAGE_TOKENS, dtype=np.uint32)


async def _settle(cache: KVCache) -> None:
    await asyncio.sleep(0.05)
    await cache.flush()


async def test_prefix_prediction_moves_a_lookups_pages_up_and_counts_them(tmp_path: Path) -> None:
    async with KVCache(_cfg(tmp_path), env={}, configure_log=False, predictor="prefix") as cache:
        first = _tokens(1, 4)
        await cache.store(first, np.zeros((4, 512), dtype=np.uint8))
        for seq in (2, 3, 4):  # push the first sequence's pages down to the disk tier
            await cache.store(_tokens(seq, 4), np.ones((4, 512), dtype=np.uint8))
        await _settle(cache)
        found = await cache.lookup(first)
        assert len(found.keys) == 4 and "disk" in found.tiers  # some pages are below
        pred = next(o for o in cache.hooks.observers if isinstance(o, LivePrefetcher))
        await asyncio.gather(*pred._tasks)  # the prefetch the lookup started
        assert all(cache.directory.is_committed(k, "dram") for k in found.keys)
        await cache.load(found.keys)
        cache.release(found.keys)
        stats = cache.stats()["predictor"]
        moved = sum(t == "disk" for t in found.tiers)
        assert stats["pages"]["issued"] == moved
        assert stats["pages"]["useful"] == moved and stats["pages"]["wasted"] == 0
        prom = cache.metrics.to_prometheus()
        assert 'kvtier_predicted_prefetch_pages_total{outcome="useful"}' in prom


async def test_prefetched_pages_evicted_unused_are_wasted(tmp_path: Path) -> None:
    async with KVCache(_cfg(tmp_path), env={}, configure_log=False, predictor="prefix") as cache:
        first = _tokens(1, 4)
        await cache.store(first, np.zeros((4, 512), dtype=np.uint8))
        for seq in (2, 3):
            await cache.store(_tokens(seq, 4), np.ones((4, 512), dtype=np.uint8))
        await _settle(cache)
        found = await cache.lookup(first)
        pred = next(o for o in cache.hooks.observers if isinstance(o, LivePrefetcher))
        await asyncio.gather(*pred._tasks)
        for seq in (5, 6, 7, 8):  # the engine never loads them; new pages push them out
            await cache.store(_tokens(seq, 4), np.ones((4, 512), dtype=np.uint8))
        await _settle(cache)
        stats = cache.stats()["predictor"]
        assert stats["pages"]["issued"] > 0
        assert stats["pages"]["wasted"] == stats["pages"]["issued"]
        assert stats["pages"]["useful"] == 0
        assert not any(cache.directory.is_committed(k, "dram") for k in found.keys)


async def test_lookahead_prefetches_pages_that_followed_before(tmp_path: Path) -> None:
    async with KVCache(_cfg(tmp_path), env={}, configure_log=False, predictor="lookahead") as cache:
        doc = _tokens(1, 6)
        await cache.store(doc, np.zeros((6, 512), dtype=np.uint8))
        await cache.lookup(doc)  # the predictor learns the document's page order
        for seq in (2, 3, 4):
            await cache.store(_tokens(seq, 4), np.ones((4, 512), dtype=np.uint8))
        await _settle(cache)
        keys = cache.page_keys(doc)
        head = doc[: 2 * PAGE_TOKENS]  # a request reading the document's first two pages
        await cache.lookup(head)
        pred = next(o for o in cache.hooks.observers if isinstance(o, LivePrefetcher))
        await asyncio.gather(*pred._tasks)
        assert cache.stats()["predictor"]["pages"]["issued"] > 0
        assert cache.directory.is_committed(keys[2], "dram")  # the page after the head


def test_unknown_predictor_is_a_usage_error() -> None:
    # the names listed are the ones the cache takes, "none" included
    with pytest.raises(
        KVTierUsageError,
        match=r"unknown predictor 'psychic'; known: prefix, lookahead, prefix\+lookahead, none$",
    ):
        KVCache({"model": {"preset": "tiny"}}, env={}, predictor="psychic")


def test_bench_run_with_and_without_the_predictor(tmp_path: Path) -> None:
    args = [
        "bench", "run", "--model", "tiny", "--sessions", "6", "--turns", "3",
        "--system-tokens", "16", "--turn-tokens", "16", "--dram-capacity", "24KiB",
        "--queue-delay-ms", "2", "--json",
    ]  # fmt: skip
    runner = CliRunner()
    plain = runner.invoke(get_app(), args)
    assert plain.exit_code == 0, plain.stderr
    with_pred = runner.invoke(get_app(), [*args, "--predictor", "prefix"])
    assert with_pred.exit_code == 0, with_pred.stderr
    a, b = json.loads(plain.stdout), json.loads(with_pred.stdout)
    assert "predictor" not in a and b["params"]["predictor"] == "prefix"
    assert b["predictor"]["pages"]["issued"] > 0
    assert a["mismatches"] == b["mismatches"] == 0
    assert b["load_latency_ms"]["count"] > 0
    bad = runner.invoke(get_app(), [*args, "--predictor", "psychic"])
    assert bad.exit_code == 2 and "unknown predictor" in bad.stderr


class SlowToStopPrefetch:
    """The cache, except that a cancelled ``prefetch`` takes 0.3 s to stop (as one that
    waits for a copy thread does)."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.started = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    async def prefetch(self, keys: Any, deadline_s: float) -> Any:
        self.started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)
            raise


async def test_aclose_cancelled_meanwhile_raises_cancelled(tmp_path: Path) -> None:
    """aclose swallowed its caller's cancellation while it waited for a prefetch to stop:
    a shutdown that cancelled it went on as if nothing had happened."""
    async with KVCache(_cfg(tmp_path), env={}, configure_log=False) as cache:
        keys = (await cache.store(_tokens(1, 2), np.zeros((2, 512), dtype=np.uint8))).keys
        target = SlowToStopPrefetch(cache)
        pred = LivePrefetcher(target, predictor="prefix")  # type: ignore[arg-type]
        pred.on_lookup(keys, ["disk", "disk"])  # a lookup found them below the top tier
        await asyncio.wait_for(target.started.wait(), 2)
        closing = asyncio.ensure_future(pred.aclose())
        await asyncio.sleep(0.05)  # aclose waits for the prefetch to stop
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        await pred.aclose()  # a second close waits for what is left, and returns
        assert pred.stats()["pages"]["issued"] == 2


@pytest.mark.parametrize(
    ("observe", "kwargs", "attached"),
    [
        ({"whatif": True, "predictor": "prefix+lookahead"}, {}, {"whatif", "predictor"}),
        ({"whatif": True, "predictor": "lookahead"}, {"whatif": False}, {"predictor"}),
        ({"predictor": "prefix"}, {"predictor": "none"}, set()),
        ({}, {"whatif": True}, {"whatif"}),
    ],
)
async def test_the_config_switches_observers_on_and_arguments_override_it(
    tmp_path: Path, observe: dict[str, object], kwargs: dict[str, object], attached: set[str]
) -> None:
    cfg = {**_cfg(tmp_path), "observe": observe}
    async with KVCache(cfg, env={}, configure_log=False, **kwargs) as cache:  # type: ignore[arg-type]
        assert {o.name for o in cache.hooks.observers} == attached
        assert attached <= set(cache.stats())


def test_whatif_must_be_a_bool() -> None:
    with pytest.raises(KVTierUsageError, match="whatif must be True or False, got 'yes'"):
        KVCache({"model": {"preset": "tiny"}}, env={}, whatif="yes")  # type: ignore[arg-type]


# -- overlapping lookups, a second predictor, bad arguments ----------------------------------


async def _demoted(cache: KVCache, seq: int, n: int) -> list[Any]:
    """``n`` pages stored, written down and moved out of the top tier (to the disk)."""
    keys = (await cache.store(_tokens(seq, n), np.zeros((n, 512), dtype=np.uint8))).keys
    await _settle(cache)
    assert await cache.demote("dram", keys) == []
    assert all(cache.directory.locate(k) == "disk" for k in keys)
    return keys


async def _in_top(cache: KVCache, keys: list[Any]) -> None:
    """Wait (5 s at most) until every key is committed in the top tier."""
    for _ in range(500):
        if all(cache.directory.is_committed(k, "dram") for k in keys):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("prefetched pages never reached the top tier")


def _balanced(stats: dict[str, Any]) -> bool:
    pages = stats["pages"]
    return bool(
        pages["arrived"] + pages["late"]
        == pages["useful"] + pages["wasted"] + stats["tracked"] + stats["forgotten"]
    )


async def test_overlapping_lookups_of_one_request_count_each_page_once(tmp_path: Path) -> None:
    """Two lookups of one request at once issued (and counted arrived) every page twice:
    16 issued, 16 arrived, 8 useful, 0 tracked for 8 pages moved."""
    async with KVCache(_cfg(tmp_path, top_pages=32), env={}, configure_log=False) as cache:
        pred = LivePrefetcher(cache, "prefix", deadline_s=5.0)
        cache.attach(pred)
        keys = await _demoted(cache, 1, 8)
        tokens = _tokens(1, 8)
        await asyncio.gather(cache.lookup(tokens), cache.lookup(tokens))
        await asyncio.gather(*pred._tasks)
        stats = pred.stats()
        assert stats["pages"]["issued"] == stats["pages"]["arrived"] == 8
        assert stats["tracked"] == 8 and _balanced(stats)
        await cache.load(keys)
        cache.release(keys)
        stats = cache.stats()["predictor"]
        assert stats["pages"]["useful"] == 8 and stats["tracked"] == 0
        assert _balanced(stats)


async def test_a_second_predictor_follows_a_detached_one(tmp_path: Path) -> None:
    """A second LivePrefetcher raised 'metric ... registered twice', even after the first
    (from KVCache(predictor=...)) was detached; a detached one kept counting pages that
    left the top tier (it still listened to the directory)."""
    async with KVCache(_cfg(tmp_path), env={}, configure_log=False, predictor="prefix") as cache:
        with pytest.raises(KVTierUsageError, match="a predictor observer is already attached"):
            cache.attach(LivePrefetcher(cache))
        first = next(o for o in cache.hooks.observers if isinstance(o, LivePrefetcher))
        keys = await _demoted(cache, 1, 4)
        await cache.lookup(_tokens(1, 4))
        await asyncio.gather(*first._tasks)
        assert first.stats()["pages"]["arrived"] + first.stats()["pages"]["late"] == 4
        await _in_top(cache, keys)  # late pages land in the background
        assert first.stats()["tracked"] == 4
        cache.hooks.detach("predictor")
        second = LivePrefetcher(cache, "prefix", deadline_s=5.0)
        cache.attach(second)
        await cache.demote("dram", keys)  # first's pages leave the top tier unused
        assert first.stats()["pages"]["wasted"] == 0  # detached: it no longer listens
        await cache.lookup(_tokens(1, 4))
        await asyncio.gather(*second._tasks)
        await cache.load(keys)
        cache.release(keys)
        assert cache.stats()["predictor"]["pages"]["useful"] == 4
        assert cache.stats()["predictor"]["pages"]["issued"] == 4  # its own count
        prom = cache.metrics.to_prometheus()  # the metric counts both predictors' pages
        assert 'kvtier_predicted_prefetch_pages_total{outcome="issued"} 8' in prom


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"deadline_s": "1"}, "deadline_s must be a number of seconds, got '1'"),
        ({"deadline_s": True}, "deadline_s must be a number of seconds, got True"),
        ({"deadline_s": float("inf")}, "deadline_s must be finite and > 0 seconds, got inf"),
        ({"deadline_s": float("nan")}, "deadline_s must be finite and > 0 seconds, got nan"),
        ({"deadline_s": 0}, "deadline_s must be finite and > 0 seconds, got 0"),
        ({"deadline_s": -1.0}, r"deadline_s must be finite and > 0 seconds, got -1\.0"),
        ({"max_inflight": "x"}, "max_inflight must be an integer >= 1, got 'x'"),
        ({"max_inflight": float("nan")}, "max_inflight must be an integer >= 1, got nan"),
        ({"max_inflight": 0}, "max_inflight must be an integer >= 1, got 0"),
        ({"max_inflight": -5}, "max_inflight must be an integer >= 1, got -5"),
        ({"max_pages": float("inf")}, "max_pages must be an integer >= 1, got inf"),
        ({"max_pages": 2.0}, r"max_pages must be an integer >= 1, got 2\.0"),
        ({"track": None}, "track must be an integer >= 1, got None"),
        ({"track": 0}, "track must be an integer >= 1, got 0"),
        ({"predictor": None}, "unknown predictor None"),
    ],
)
async def test_live_prefetcher_arguments_are_checked_by_name(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    """They raised TypeError, ValueError or OverflowError without the argument's name, or
    were clamped to 1 (max_inflight=0) or taken (deadline_s=inf)."""
    async with KVCache(_cfg(tmp_path), env={}, configure_log=False) as cache:
        with pytest.raises(KVTierUsageError, match=match):
            LivePrefetcher(cache, **kwargs)


async def test_live_prefetcher_defaults_and_numpy_integers(tmp_path: Path) -> None:
    async with KVCache(_cfg(tmp_path), env={}, configure_log=False) as cache:
        pred = LivePrefetcher(cache, max_inflight=np.int32(2), deadline_s=np.float64(0.5))  # type: ignore[arg-type]
        assert (pred.max_inflight, pred.deadline_s) == (2, 0.5)
        default = LivePrefetcher(cache)
        assert (default.deadline_s, default.max_inflight, default.max_pages, default.track) == (
            0.05,
            4,
            256,
            1 << 16,
        )
