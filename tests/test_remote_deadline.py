"""One deadline per call on a frozen remote server, seen through a ``KVCache``.

docs/remote.md promises that during an outage "every call returns within about one
deadline" (``op_timeout_s``). A cache ``read`` or ``load`` whose pages are only on the
remote tier makes two store calls: the ``get`` and then, for the pages it missed, a
``contains`` asking whether they are gone (``purge_vanished``). With the server frozen
(``SIGSTOP``) the ``contains`` used to wait out a deadline of its own, so every read and
load of the outage took two deadlines (1.0 s with ``op_timeout_s=0.5``). Now a
``contains`` asked right after a failed batch, while the server has not answered since,
raises at once (it cannot say; the cache keeps the pages), and the pages are served again,
byte-exact, once the server answers.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
from cache_kit import dram_over_redis, sequence_below_dram
from kvtier.backends.remote import RedisStore
from structlog.testing import capture_logs

from kvtier.cache import KVCache
from kvtier.errors import TierIOError
from kvtier.keys import Namespace, page_keys
from kvtier.testing.servers import RedisServer, unavailable_reason

pytestmark = pytest.mark.skipif(
    unavailable_reason("valkey") is not None, reason=str(unavailable_reason("valkey"))
)

TIMEOUT = 1.0  # op_timeout_s of the remote tier
#: What one call may take on a frozen server: one deadline and generous scheduling slack
#: on a loaded 2-core machine, yet well under the two deadlines the defect cost.
BOUND = 1.6 * TIMEOUT
PAGES = 12


def _config(url: str) -> dict[str, object]:
    return dram_over_redis(url, op_timeout_s=TIMEOUT, connect_timeout_s=TIMEOUT)


async def _timed(coro):  # type: ignore[no-untyped-def]
    start = time.monotonic()
    result = await coro
    return result, time.monotonic() - start


@pytest.mark.parametrize("call", ["read", "load"])
async def test_each_call_on_a_frozen_server_waits_one_deadline_not_two(call: str) -> None:
    rng = np.random.default_rng(3)
    with RedisServer("valkey") as server:
        async with KVCache(_config(server.url), env={}, configure_log=False) as cache:
            keys, pages = await sequence_below_dram(cache, rng, PAGES)
            out = np.zeros_like(pages)
            took: list[float] = []
            server.pause()  # SIGSTOP: connections stay open, nothing answers
            try:
                for _ in range(2):  # every call of the outage, not only the first
                    if call == "read":
                        hits, t = await _timed(asyncio.wait_for(cache.read(keys, out), 30))
                        assert not any(hits)
                    else:
                        loaded, t = await _timed(asyncio.wait_for(cache.load(keys[:4]), 30))
                        cache.release(keys[:4])
                        assert loaded.missing == keys[:4]
                    took.append(t)
            finally:
                server.resume()
            assert all(t < BOUND for t in took), (
                f"{call} on a frozen server took {[round(t, 2) for t in took]} s "
                f"(op_timeout_s={TIMEOUT}, bound {BOUND} s)"
            )
            assert all(cache.directory.is_committed(k, "remote") for k in keys), (
                "the cache forgot pages the server still holds"
            )
            await asyncio.sleep(TIMEOUT)  # past the window in which contains is not sent
            hits = await cache.read(keys, out)
            assert all(hits)
            np.testing.assert_array_equal(out, pages)


async def test_contains_right_after_a_failed_batch_raises_at_once_then_asks_again() -> None:
    ns = Namespace("deadline")
    keys = page_keys(np.arange(4 * ns.page_tokens) + int.from_bytes(os.urandom(3)), ns)
    data = [np.full(4096, i, np.uint8) for i in range(4)]
    with RedisServer("valkey") as server:
        store = RedisStore(
            page_bytes=4096, capacity_pages=64, url=server.url,
            op_timeout_s=TIMEOUT, connect_timeout_s=TIMEOUT,
        )  # fmt: skip
        async with store as s:
            assert await s.put(keys, data) == [True] * 4
            out = [np.zeros(4096, np.uint8) for _ in keys]
            server.pause()
            try:
                hits, t_get = await _timed(s.get(keys, out))
                assert hits == [False] * 4 and t_get < BOUND
                start = time.monotonic()
                with pytest.raises(TierIOError, match=r"no answer for 4 of 4 keys \(not asked"):
                    await s.contains(keys)
                assert time.monotonic() - start < 0.3 * TIMEOUT
                assert s.stats()["skipped_batches"] == 1
            finally:
                server.resume()
            await asyncio.sleep(TIMEOUT)  # the window is over: the next question is sent
            assert await s.contains(keys) == [True] * 4
            assert await s.get(keys, out) == [True] * 4
            assert all(np.array_equal(o, d) for o, d in zip(out, data, strict=True))


async def test_delete_on_a_frozen_server_waits_one_deadline_not_one_per_pass() -> None:
    """``delete`` goes over the tiers again while copies of its pages land (a prefetch
    under way); a page whose delete the frozen server did not answer was asked again on
    every pass, 2 x tiers + 2 of them: 6 deadlines with DRAM over Redis. Now a page a
    tier failed to delete is not asked there again in the same call; it stays indexed
    (the server may still hold it) and goes once the server answers."""
    rng = np.random.default_rng(4)
    with RedisServer("valkey") as server:
        async with KVCache(_config(server.url), env={}, configure_log=False) as cache:
            keys, pages = await sequence_below_dram(cache, rng, PAGES)
            server.pause()
            try:
                with capture_logs() as logs:
                    removed, took = await _timed(asyncio.wait_for(cache.delete(keys[-4:]), 30))
            finally:
                server.resume()
            # the pages the server kept are named (a soak probe read 316 pages back after
            # deletes that returned normally, with nothing said)
            said = [e for e in logs if e["event"].startswith("delete could not remove every")]
            assert len(said) == 1 and said[0]["pages"] == {"remote": 4}, logs
            assert took < BOUND, f"delete on a frozen server took {took:.2f} s (bound {BOUND})"
            assert removed == 0
            assert all(cache.directory.is_committed(k, "remote") for k in keys[-4:])
            await asyncio.sleep(TIMEOUT)  # past the window in which contains is not sent
            assert await cache.delete(keys[-4:]) == 4
            out = np.zeros_like(pages)
            hits = await cache.read(keys, out)
            assert hits == [True] * (PAGES - 4) + [False] * 4
            np.testing.assert_array_equal(out[:-4], pages[:-4])


async def test_close_with_dirty_pages_on_a_frozen_server_waits_one_deadline() -> None:
    """Write-through pages whose write-down timed out on a frozen server: ``close``'s
    flush asked the server again (a reserve's ``EXISTS``) and waited a second deadline
    (2.01 s with a 1 s deadline). A write-down's reserve right after a failed batch is
    now refused at once, as ``contains`` is; the pages stay dirty in DRAM, and close
    names them as lost."""
    rng = np.random.default_rng(5)
    with RedisServer("valkey") as server:
        cache = KVCache(_config(server.url), env={}, configure_log=False)
        await cache.start()
        server.pause()
        try:
            tokens = rng.integers(0, 50_000, 4 * cache.spec.page_tokens)
            pages = rng.integers(0, 256, (4, cache.spec.page_bytes), dtype=np.uint8)
            assert all((await cache.store(tokens, pages)).stored)  # DRAM holds them
            _, took = await _timed(asyncio.wait_for(cache.close(), 30))
        finally:
            server.resume()
        assert took < BOUND, f"close on a frozen server took {took:.2f} s (bound {BOUND})"
        assert cache.metrics.snapshot()["tiers"]["dram"]["dropped_pages"] == 4
