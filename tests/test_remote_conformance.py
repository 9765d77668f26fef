"""The backend conformance kit against RedisStore: Valkey and Redis single node, and a
three-master Redis cluster (``redis-cli --cluster create``)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import redis
from kvtier.backends.remote import RedisStore

from kvtier.keys import Namespace, page_keys
from kvtier.testing.conformance import check_backend
from kvtier.testing.servers import RedisClusterServers, RedisServer, unavailable_reason


def _factory(url: str, cluster: bool = False):  # type: ignore[no-untyped-def]
    return lambda: RedisStore(
        page_bytes=4096, capacity_pages=16, url=url, cluster=cluster, key_prefix="conformance"
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    reason = unavailable_reason("redis", cluster=True)
    if reason:
        pytest.skip(reason)
    with RedisClusterServers("redis") as c:
        yield c


@pytest.mark.parametrize("flavor", ["valkey", "redis"])
async def test_conformance_single_node(flavor: str) -> None:
    reason = unavailable_reason(flavor)  # type: ignore[arg-type]
    if reason:
        pytest.skip(reason)
    with RedisServer(flavor) as server:  # type: ignore[arg-type]
        report = await check_backend(_factory(server.url), persistent=True)
    assert "survives_reopen" in report.passed and "uncommitted_invisible" in report.passed
    assert set(report.skipped) == {"arena_zero_copy"}


async def test_conformance_cluster(cluster: RedisClusterServers) -> None:
    report = await check_backend(_factory(cluster.url, cluster=True), persistent=True)
    assert set(report.skipped) == {"arena_zero_copy"}


async def test_cluster_spreads_pages_over_every_master(cluster: RedisClusterServers) -> None:
    ns = Namespace("cluster-spread")
    keys = page_keys(np.arange(64 * ns.page_tokens), ns)
    data = [np.full(4096, i, np.uint8) for i in range(64)]
    async with RedisStore(
        page_bytes=4096, capacity_pages=64, url=cluster.url, cluster=True, key_prefix="spread"
    ) as store:
        assert await store.put(keys, data, ns.label) == [True] * 64
        per_node = []
        for node in cluster.nodes:
            raw = redis.Redis(port=node.port)
            per_node.append(len(raw.keys(b"spread:*")))
            raw.close()
        assert sum(per_node) == 64 and all(n > 0 for n in per_node), per_node
        out = [np.zeros(4096, np.uint8) for _ in keys]
        assert await store.get(keys, out) == [True] * 64
        assert all(int(o[0]) == i and (o == i).all() for i, o in enumerate(out))
        assert sorted(await store.keys()) == sorted(keys)
        await store.delete(keys)
