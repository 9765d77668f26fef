"""A remote tier whose server stops answering for a while, seen through a ``KVCache``.

The pages stay on the server. While it is frozen they are misses; once it answers again
the cache serves them again, byte-exact, from the keys the caller already holds (no new
``lookup``). Before ``RedisStore.contains`` raised for keys it got no answer for, it said
``False``, the cache took that as "gone" and forgot every page a read or load touched
during the outage.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis
from cache_kit import dram_over_redis, sequence_below_dram

from kvtier.cache import KVCache
from kvtier.testing.servers import RedisServer, free_port, unavailable_reason

pytestmark = pytest.mark.skipif(
    unavailable_reason("valkey") is not None, reason=str(unavailable_reason("valkey"))
)

PAGES = 20


def _config(url: str) -> dict[str, object]:
    return dram_over_redis(url, op_timeout_s=0.5, connect_timeout_s=0.5)


@pytest.mark.parametrize("call", ["read", "load"])
async def test_pages_a_frozen_server_still_holds_are_served_again_after(call: str) -> None:
    rng = np.random.default_rng(11)
    with RedisServer("valkey") as server:
        async with KVCache(_config(server.url), env={}, configure_log=False) as cache:
            keys, pages = await sequence_below_dram(cache, rng, PAGES)
            assert all(cache.directory.is_committed(k, "remote") for k in keys)
            out = np.zeros_like(pages)
            server.pause()  # SIGSTOP: connections stay open, nothing answers
            try:
                if call == "read":
                    hits = await asyncio.wait_for(cache.read(keys, out), 30)
                    assert not any(hits)
                else:
                    loaded = await asyncio.wait_for(cache.load(keys[:6]), 30)
                    cache.release(keys[:6])
                    assert loaded.missing == keys[:6]
            finally:
                server.resume()
            assert all(cache.directory.is_committed(k, "remote") for k in keys), (
                "the cache forgot pages the server still holds"
            )
            hits = await cache.read(keys, out)
            assert all(hits)
            np.testing.assert_array_equal(out, pages)


async def test_a_read_cancelled_on_a_frozen_server_raises_at_once_and_writes_nothing_after() -> (
    None
):
    """``RedisStore`` promises ``get_finishes_before_raising``: a cancelled get aborts its
    batches and waits for their threads, so the cache awaits it with no shield. A read
    cancelled while the server is frozen then raises at once, not after the tier's
    ``op_timeout_s`` (30 s here; before, the shielded get ran to its deadline), and the
    server's late replies, once it is thawed, reach no buffer of the caller."""
    rng = np.random.default_rng(12)
    config = _config("")
    remote = config["tiers"][1]  # type: ignore[index]
    with RedisServer("valkey") as server:
        remote["options"] = {"url": server.url, "op_timeout_s": 30.0}
        async with KVCache(config, env={}, configure_log=False) as cache:
            keys, pages = await sequence_below_dram(cache, rng, 8)
            out = np.zeros_like(pages)
            server.pause()
            try:
                task = asyncio.create_task(cache.read(keys, out))
                await asyncio.sleep(0.3)  # its batches wait on the frozen server
                task.cancel()
                start = loop_time()
                with pytest.raises(asyncio.CancelledError):
                    await task
                took = loop_time() - start
                server.resume()
                await asyncio.sleep(0.3)  # a late reply would have landed by now
            finally:
                server.resume()
            assert took < 5.0, f"the cancelled read raised after {took:.1f} s"
            assert not out.any(), f"{int(out.any(axis=1).sum())} pages written after it raised"
            for _ in range(50):  # the aborted connections are opened again
                if all(await cache.read(keys, out)):
                    break
                await asyncio.sleep(0.1)
            assert np.array_equal(out, pages)


def loop_time() -> float:
    return asyncio.get_running_loop().time()


@pytest.mark.parametrize("call", ["read", "load"])
async def test_pages_the_server_lost_are_misses_not_an_outage(call: str) -> None:
    """docs/remote.md: pages the server evicts on its own (or loses: ``FLUSHALL``, a TTL,
    another client's ``DEL``) are simply misses. A read or load whose every page was gone
    marked the tier failing ("tier failing", ``healthy`` False, an outage open) on a
    server that answered every call. A frozen server still opens an outage (checked
    after, so this test can tell the two apart)."""
    rng = np.random.default_rng(12)
    with RedisServer("valkey") as server:
        async with KVCache(_config(server.url), env={}, configure_log=False) as cache:
            keys, _ = await sequence_below_dram(cache, rng, PAGES)
            with redis.Redis(port=server.port) as admin:
                admin.flushall()
            out = np.zeros((PAGES, cache.spec.page_bytes), np.uint8)
            if call == "read":
                assert await cache.read(keys, out) == [False] * PAGES
            else:
                loaded = await cache.load(keys[:6])
                cache.release(keys[:6])
                assert loaded.missing == keys[:6]
            remote = cache.stats()["tiers"][1]
            assert (remote["healthy"], remote["outages"]) == (True, 0), remote
            assert not any(cache.directory.is_committed(k, "remote") for k in keys[:6])

            keys, _ = await sequence_below_dram(cache, rng, PAGES)
            server.pause()
            try:
                assert await asyncio.wait_for(cache.read(keys, out), 30) == [False] * PAGES
            finally:
                server.resume()
            remote = cache.stats()["tiers"][1]
            assert (remote["healthy"], remote["outages"]) == (False, 1), remote


async def test_write_downs_to_a_server_that_is_not_there_mark_the_tier_failing() -> None:
    """Nothing listens at the pool's address: every write-down fails at its reserve
    (the store cannot tell which pages are on the server). The reserve answered ``None``
    (read by the pipeline as "no room"), so the tier stayed healthy with no failed page
    counted while not one page reached the pool; it now raises, and the tier is failing."""
    cfg = dram_over_redis(
        f"redis://127.0.0.1:{free_port()}/0", op_timeout_s=0.5, connect_timeout_s=0.5
    )
    async with KVCache(cfg, env={}, configure_log=False) as cache:
        tokens = np.arange(4 * cache.spec.page_tokens)
        data = np.ones((4, cache.spec.page_bytes), np.uint8)
        assert (await cache.store(tokens, data)).stored == [True] * 4  # DRAM holds them
        await cache.flush()
        remote = cache.stats()["tiers"][1]
        assert (remote["healthy"], remote["outages"]) == (False, 1), remote
        assert cache.metrics.snapshot()["tiers"]["remote"]["failed_pages"] > 0


def _redis() -> None:
    reason = unavailable_reason("redis")
    if reason:
        pytest.skip(reason)


async def test_a_url_password_for_a_server_without_one_stores_and_says_so(caplog) -> None:
    """The URL gives a password, the server has none. redis-py (reserve, contains, scan)
    connects anyway; the page data path refused ("AUTH called without any password
    configured"), so nothing reached the pool while the outage opened and closed on every
    batch and the tier looked healthy. Both paths now connect, and one line says the
    password protects nothing."""
    import logging

    _redis()
    with RedisServer("redis") as server:
        url = server.url.replace("redis://", "redis://:secretpw@")
        with caplog.at_level(logging.WARNING, logger="kvtier.backends.remote"):
            async with KVCache(dram_over_redis(url), env={}, configure_log=False) as cache:
                tokens = np.arange(6 * cache.spec.page_tokens)
                data = np.random.default_rng(5).integers(0, 256, (6, cache.spec.page_bytes))
                assert all((await cache.store(tokens, data.astype(np.uint8))).stored)
                await cache.flush()
                remote = cache.metrics.snapshot()["tiers"]["remote"]
                assert (remote["stored_pages"], remote["failed_pages"]) == (6, 0), remote
        assert redis.Redis(port=server.port).dbsize() == 6
    lines = [r.getMessage() for r in caplog.records]
    assert sum("gives a password but the server 127.0.0.1" in m for m in lines) == 1, lines
    assert not any("unavailable (" in m for m in lines), lines


async def test_a_link_counts_pages_the_store_refused_at_commit_as_failed() -> None:
    """A remote store sends pages at commit. Its link counted every page staged by
    ``write`` as moved (with GB/s) even when every commit failed; it now counts pages
    committed, and the rest as ``link_failed_pages``."""
    _redis()
    users = ["default on nopass ~* &* +@all", "ro on >ropw ~* &* +@all -set"]
    with RedisServer("redis", acl_users=users) as server:
        url = server.url.replace("redis://", "redis://ro:ropw@")
        async with KVCache(dram_over_redis(url), env={}, configure_log=False) as cache:
            tokens = np.arange(6 * cache.spec.page_tokens)
            data = np.ones((6, cache.spec.page_bytes), np.uint8)
            assert all((await cache.store(tokens, data)).stored)  # DRAM holds them
            await cache.flush()
            link = cache.metrics.snapshot()["links"]["dram->remote"]
            assert link["pages"] == 0 and link["failed_pages"] >= 6, link
        assert redis.Redis(port=server.port).dbsize() == 0
