"""Stores of the same pages side by side: what each call reports stored stays readable.

A store removes the pages it committed past one of its own pages that ended up cached
nowhere (no lookup reaches them). Two stores of the same sequence each count such a page;
the one that removes it first used to leave the other reporting it stored, and the page
read back as a miss (the cancellation fuzz of ``tests/test_cancellation.py`` lost 20
of 400 runs' pages this way, seeds 0-199 of both write policies).

Real DRAM (refusing chosen pages) over a real file store, the tiny model.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from cache_kit import PAGE, RefusingArena, config, open_cache, sequence


@pytest.fixture(autouse=True)
def _no_refusals():
    yield
    RefusingArena.refused = set()
    RefusingArena.gated = set()
    RefusingArena.gate = None


def _config(tmp_path: Path) -> dict:
    cfg = config(tmp_path, dram_pages=16, file_pages=64, batch_pages=1)
    cfg["tiers"][0]["backend"] = "cache_kit:RefusingArena"
    return cfg


@pytest.mark.parametrize("calls", [2, 3])
async def test_a_page_past_a_gap_is_reported_stored_by_no_call(tmp_path: Path, calls: int):
    """The top tier refuses the first two pages of a three-page sequence stored by
    ``calls`` calls at once: the third page lands (once) and is removed as an orphan, so
    no call may report it stored. Before, all but the first call to finish did."""
    rng = np.random.default_rng(1)
    tokens, data = sequence(rng, 3)
    async with open_cache(_config(tmp_path)) as cache:
        keys = cache.page_keys(tokens)
        RefusingArena.refused = set(keys[:2])
        results = await asyncio.gather(*(cache.store(tokens, data) for _ in range(calls)))
        await cache.pipeline.drain()
        out = np.zeros((3, PAGE), dtype=np.uint8)
        readable = await cache.read(keys, out)
        assert readable == [False, False, False]  # nothing kept past the gap
        for res in results:
            assert res.stored == [False, False, False]
        cache.directory.check_invariants()

        RefusingArena.refused = set()  # the tier takes them again: all three are stored
        res = await cache.store(tokens, data)
        assert res.stored == [True, True, True]
        assert await cache.read(keys, out) == [True, True, True]
        assert np.array_equal(out, data)


async def test_every_page_a_call_reports_stored_reads_back(tmp_path: Path):
    """Many overlapping stores of sequences sharing a prefix, some pages refused: each
    page any call reports stored reads back with its bytes once the calls have ended."""
    rng = np.random.default_rng(7)
    tokens, data = sequence(rng, 6)
    async with open_cache(_config(tmp_path)) as cache:
        keys = cache.page_keys(tokens)
        RefusingArena.refused = {keys[1], keys[4]}
        lengths = [int(n) for n in rng.integers(1, 7, size=12)]
        results = await asyncio.gather(*(cache.store(tokens[: n * 4], data[:n]) for n in lengths))
        await cache.pipeline.drain()
        reported = [
            k for k in keys if any(k in r.keys and r.stored[r.keys.index(k)] for r in results)
        ]
        out = np.zeros((len(reported), PAGE), dtype=np.uint8)
        assert await cache.read(reported, out) == [True] * len(reported)
        assert all(np.array_equal(out[i], data[keys.index(k)]) for i, k in enumerate(reported))
        assert reported == [keys[0]]  # every other page follows a refused one


async def test_a_page_found_committed_is_not_reported_once_its_store_removes_it(tmp_path):
    """Store A's first page is held in its write (then refused), its second refused, its
    third lands. Store B of the same pages starts meanwhile: it finds the third page
    committed and counts it, then writes the first two itself. A, ending, removes its
    third page as an orphan (its first two are cached nowhere yet). B used to report all
    three stored; the third read back as a miss. Now B reports it only if it is still
    there, and A removes it only if it is still past a gap when the removal begins."""
    rng = np.random.default_rng(3)
    tokens, data = sequence(rng, 3)
    async with open_cache(_config(tmp_path)) as cache:
        keys = cache.page_keys(tokens)
        RefusingArena.refused = set(keys[:2])
        RefusingArena.gated = {keys[0]}
        RefusingArena.gate = asyncio.Event()
        a = asyncio.ensure_future(cache.store(tokens, data))
        while not cache.directory.is_committed(keys[2], "dram"):
            await asyncio.sleep(0.001)
        assert RefusingArena.held == 1
        b = asyncio.ensure_future(cache.store(tokens, data))
        await asyncio.sleep(0.01)  # B waits for A's first page to settle
        RefusingArena.refused = set()
        RefusingArena.gated = set()
        RefusingArena.gate.set()
        res_a, res_b = await a, await b
        await cache.pipeline.drain()
        assert res_a.stored == [False, False, False]
        out = np.zeros((3, PAGE), dtype=np.uint8)
        readable = await cache.read(keys, out)
        for k, ok, hit in zip(keys, res_b.stored, readable, strict=True):
            assert hit or not ok, f"page {keys.index(k)} reported stored by B, not readable"
        assert res_b.stored[:2] == [True, True]
        cache.directory.check_invariants()


async def test_stores_far_longer_than_the_hierarchy_end_and_let_others_through(
    tmp_path: Path,
) -> None:
    """Two stores of 12,000 and 15,000 pages over a hierarchy of 76 pages, and a 6-page
    store behind them. Once a batch of a store lands nowhere, its later batches could
    only land orphans; they used to wait their turn for room one after another (a
    docs-only probe saw no store return for 70 s, 23,000 and 28,500 pages over 268).
    Now they are cancelled: the three calls end within 15 s (here 2 s; before, 42 s), the
    small store is whole, and what reads back of the long ones is their own bytes."""
    cfg = config(tmp_path, dram_pages=12, file_pages=64, batch_pages=2)
    async with open_cache(cfg) as cache:
        sizes = [12_000, 15_000]
        seqs = [
            (np.arange(j * 10**7, j * 10**7 + n * 4), np.full((n, PAGE), j + 1, np.uint8))
            for j, n in enumerate(sizes)
        ]
        longs = [cache.store(t, d) for t, d in seqs]
        small_tokens = np.arange(5 * 10**7, 5 * 10**7 + 24)
        small_store = cache.store(small_tokens, np.ones((6, PAGE), np.uint8))
        *results, small = await asyncio.wait_for(asyncio.gather(*longs, small_store), 15)
        assert small.stored == [True] * 6
        for (_, data), res in zip(seqs, results, strict=True):
            kept = [k for k, ok in zip(res.keys, res.stored, strict=True) if ok]
            assert 0 < len(kept) < 100
            out = np.zeros((len(kept), PAGE), np.uint8)
            hits = await cache.read(kept, out)  # later stores may have pushed them out
            assert all((row == data[0]).all() for row, hit in zip(out, hits, strict=True) if hit)
        cache.directory.check_invariants()
