"""Two live caches on one shared remote tier: what one stores, the other finds.

A decode server that is already running must see pages a prefill server stores after it
opened: ``KVCache.lookup`` asks shared tiers about pages its directory does not know.
"""

from __future__ import annotations

import numpy as np
import pytest
from cache_kit import dram_over_redis

from kvtier.cache import KVCache
from kvtier.testing.servers import RedisServer, unavailable_reason


def _config(url: str) -> dict[str, object]:
    return dram_over_redis(url, dram_pages=64, key_prefix="kvtier-shared-test")


async def test_running_cache_finds_pages_another_cache_stored_after_it_opened() -> None:
    reason = unavailable_reason("valkey")
    if reason:
        pytest.skip(reason)
    rng = np.random.default_rng(3)
    with RedisServer("valkey") as server:
        cfg = _config(server.url)
        async with KVCache(cfg, env={}, configure_log=False) as decode:
            async with KVCache(cfg, env={}, configure_log=False) as prefill:
                tokens = rng.integers(0, 50_000, 6 * prefill.spec.page_tokens + 2)
                pages = rng.integers(0, 256, (6, prefill.spec.page_bytes), dtype=np.uint8)
                stored = await prefill.store(tokens, pages)
                assert all(stored.stored)
                await prefill.flush()  # write-through copies are in the remote tier
            # decode opened before the pages existed: only the shared tier knows them
            assert not decode.directory.is_committed(stored.keys[0], "remote")
            found = await decode.lookup(tokens)
            assert found.keys == stored.keys
            assert found.tiers == ["remote"] * 6
            assert found.cached_tokens == 6 * decode.spec.page_tokens
            out = np.zeros_like(pages)
            assert all(await decode.read(found.keys, out))
            np.testing.assert_array_equal(out, pages)
            # a prefix nobody stored is still a miss
            other = rng.integers(0, 50_000, 3 * decode.spec.page_tokens)
            assert (await decode.lookup(other)).keys == []
