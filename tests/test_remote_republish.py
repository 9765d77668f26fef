"""A prefill server hands pages to decode servers through a shared remote pool. When the
pool loses them (a server restart or FLUSHALL, its own LRU, another server's delete),
the same prefill process storing the same prompt again must put them back. Before, its
directory still counted them as in the pool, so every later store was a no-op there:
``stored`` answered True while the server held nothing, and decode servers recomputed
forever (a docs-only probe of the hand-off)."""

from __future__ import annotations

import numpy as np
import pytest
import redis
from cache_kit import dram_over_redis

from kvtier.cache import KVCache
from kvtier.testing.servers import RedisServer, unavailable_reason

pytestmark = pytest.mark.skipif(
    unavailable_reason("valkey") is not None, reason=str(unavailable_reason("valkey"))
)

PAGES = 6


def _config(url: str) -> dict[str, object]:
    return dram_over_redis(url, dram_pages=16, op_timeout_s=2.0)


async def _pool_pages(url: str, tokens: np.ndarray, pages: np.ndarray) -> int:
    """Pages of ``tokens`` another process (a fresh cache) finds in the pool, byte-exact."""
    async with KVCache(_config(url), env={}, configure_log=False) as other:
        keys = other.page_keys(tokens)
        found = await other.lookup(tokens)
        out = np.zeros_like(pages)
        hits = await other.read(keys, out)
        assert all(np.array_equal(out[i], pages[i]) for i, h in enumerate(hits) if h)
        return min(len(found.keys), sum(hits))


@pytest.mark.parametrize("loss", ["flushall", "restart", "other-delete"])
async def test_a_store_puts_pages_the_pool_lost_back(loss: str) -> None:
    rng = np.random.default_rng(3)
    with RedisServer("valkey") as server:
        async with KVCache(_config(server.url), env={}, configure_log=False) as prefill:
            tokens = rng.integers(0, 50_000, PAGES * prefill.spec.page_tokens)
            pages = rng.integers(0, 256, (PAGES, prefill.spec.page_bytes), dtype=np.uint8)
            assert all((await prefill.store(tokens, pages)).stored)
            await prefill.flush()
            assert await _pool_pages(server.url, tokens, pages) == PAGES
            if loss == "flushall":
                redis.Redis.from_url(server.url).flushall()
            elif loss == "restart":
                server.restart()  # no persistence: the pool comes back empty
            else:  # another server evicts these pages from the pool
                async with KVCache(_config(server.url), env={}, configure_log=False) as other:
                    await other.lookup(tokens)
                    await other.delete(other.page_keys(tokens))
            assert await _pool_pages(server.url, tokens, pages) == 0
            for _ in range(2):  # the first store may meet the restarted server reconnecting
                assert all((await prefill.store(tokens, pages)).stored)
                await prefill.flush()
            assert await _pool_pages(server.url, tokens, pages) == PAGES


@pytest.mark.parametrize("loss", ["flushall", "restart"])
async def test_prompts_stored_again_back_to_back_all_go_back(loss: str) -> None:
    """More prompts than the DRAM tier holds, stored again one after the other: the DRAM
    tier evicts one prompt's pages while the next is stored. Counted in the pool, they
    left as clean before the write-through had checked that the pool still had them, so
    most were lost: a docs-only probe (8-page DRAM, 8 prompts of 4 pages) found 6 of 32
    pages in the pool and 28 of 32 missing in every tier, each store answering True."""
    rng = np.random.default_rng(5)
    prompts = 8
    with RedisServer("valkey") as server:
        cfg = dram_over_redis(server.url, dram_pages=8, op_timeout_s=2.0)
        async with KVCache(cfg, env={}, configure_log=False) as prefill:
            pt, pb = prefill.spec.page_tokens, prefill.spec.page_bytes
            sequences = [
                (rng.integers(0, 50_000, 4 * pt), rng.integers(0, 256, (4, pb), dtype=np.uint8))
                for _ in range(prompts)
            ]
            for tokens, pages in sequences:
                assert all((await prefill.store(tokens, pages)).stored)
            await prefill.flush()
            if loss == "flushall":
                redis.Redis.from_url(server.url).flushall()
            else:
                server.restart()
            for tokens, pages in sequences:  # back to back, no flush between
                assert all((await prefill.store(tokens, pages)).stored)
            await prefill.flush()
        for tokens, pages in sequences:
            assert await _pool_pages(server.url, tokens, pages) == 4


async def test_a_check_cancelled_before_it_started_lets_its_pages_go() -> None:
    """The pages a store holds for its write-through's check are let go when that task
    ends, even cancelled before its first step (closing cancels background tasks)."""
    rng = np.random.default_rng(6)
    with RedisServer("valkey") as server:
        cfg = dram_over_redis(server.url, dram_pages=8, op_timeout_s=2.0)
        async with KVCache(cfg, env={}, configure_log=False) as prefill:
            planner = prefill.pipeline.mover.planner
            tokens = rng.integers(0, 50_000, 4 * prefill.spec.page_tokens)
            pages = rng.integers(0, 256, (4, prefill.spec.page_bytes), dtype=np.uint8)
            assert all((await prefill.store(tokens, pages)).stored)
            await prefill.flush()
            assert all((await prefill.store(tokens, pages)).stored)  # counted in the pool
            assert sum(planner.checking.values()) == 4 and planner.checks_running == 4
            await prefill.pipeline.mover.cancel_all()  # before the check's first step
            assert not planner.checking and planner.checks_running == 0
            assert all((await prefill.store(tokens, pages)).stored)
