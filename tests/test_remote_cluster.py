"""RedisStore's data path in a three-master cluster when a slot moves under it.

The data path routes each page by the slot map redis-py keeps; a node that no longer owns
a slot answers ``MOVED`` (or ``ASK`` during a migration), and those pages must be sent
again through redis-py's cluster pipeline, which follows the redirection: a put lands on
the new owner and a get reads it from there, byte-exact.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis
from kvtier.backends.remote import RedisStore
from redis.cluster import key_slot

from kvtier.keys import Namespace, PageKey, page_keys
from kvtier.testing.servers import RedisClusterServers, unavailable_reason

PAGE = 4096
NS = Namespace("cluster-redirect")


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    reason = unavailable_reason("redis", cluster=True)
    if reason:
        pytest.skip(reason)
    with RedisClusterServers("redis") as c:
        yield c


def node_ids(cluster: RedisClusterServers) -> dict[int, str]:
    """Port -> node id."""
    out = {}
    for node in cluster.nodes:
        with redis.Redis(port=node.port) as r:
            out[node.port] = r.execute_command("CLUSTER", "MYID").decode()
    return out


def owner(cluster: RedisClusterServers, slot: int) -> int:
    """Port of the node serving ``slot``."""
    with redis.Redis(port=cluster.nodes[0].port) as r:
        for start, end, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return int(master[1])
    raise AssertionError(f"slot {slot} is not served")


def fresh_key(store: RedisStore, cluster: RedisClusterServers) -> tuple[PageKey, int]:
    """A page key whose slot holds no key yet (so it may be moved freely)."""
    while True:
        key = page_keys(np.arange(NS.page_tokens) + int.from_bytes(os.urandom(4)), NS)[0]
        slot = key_slot(store.page_name(key))
        port = owner(cluster, slot)
        with redis.Redis(port=port) as r:
            if r.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0:
                return key, slot


def owner_seen_by(port: int, slot: int) -> int | None:
    """Port of the node that the node on ``port`` says serves ``slot``."""
    with redis.Redis(port=port) as r:
        for start, end, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return int(master[1])
    return None


def move_slot(cluster: RedisClusterServers, slot: int, to_port: int) -> None:
    """Give ``slot`` to the node on ``to_port`` and return once every node says so. The new
    owner claims it first and bumps its config epoch, so that gossip the old owner sent
    before it was told cannot take the slot back (two nodes each answering ``MOVED`` to
    the other would exhaust the client's redirections)."""
    ids = node_ids(cluster)
    with redis.Redis(port=to_port) as r:
        r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[to_port])
        r.execute_command("CLUSTER", "BUMPEPOCH")
    deadline = time.monotonic() + 20.0
    while True:
        stale = [port for port in ids if owner_seen_by(port, slot) != to_port]
        if not stale:
            return
        assert time.monotonic() < deadline, f"slot {slot}: nodes {stale} still see another owner"
        for port in stale:
            with redis.Redis(port=port) as r:
                r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[to_port])
        time.sleep(0.05)


async def test_a_moved_slot_is_followed_for_puts_and_gets(cluster: RedisClusterServers) -> None:
    data = [np.random.default_rng(7).integers(0, 256, PAGE, dtype=np.uint8)]
    async with RedisStore(page_bytes=PAGE, capacity_pages=64, url=cluster.url, cluster=True,
                          key_prefix="moved", op_timeout_s=5.0) as store:  # fmt: skip
        warm = page_keys(np.arange(4 * NS.page_tokens), NS)
        assert await store.put(warm, [data[0]] * 4) == [True] * 4  # the slot map is loaded
        key, slot = fresh_key(store, cluster)
        old = owner(cluster, slot)
        new = next(n.port for n in cluster.nodes if n.port != old)
        move_slot(cluster, slot, new)
        assert await store.put([key], data) == [True]  # sent to the old owner: MOVED
        assert store.stats()["redirected_pages"] >= 1
        with redis.Redis(port=new) as r:
            assert r.exists(store.page_name(key)) == 1  # it landed on the new owner
        out = [np.zeros(PAGE, np.uint8)]
        assert await store.get([key], out) == [True]
        np.testing.assert_array_equal(out[0], data[0])
        assert await store.delete([key, *warm]) == [True] * 5


async def test_a_migrating_slot_is_followed_with_ask(cluster: RedisClusterServers) -> None:
    """During a migration the old owner answers ``ASK`` for keys it does not hold: a new
    page goes to the importing node, and a page still on the old owner is read there."""
    data = [np.random.default_rng(i).integers(0, 256, PAGE, dtype=np.uint8) for i in range(2)]
    async with RedisStore(page_bytes=PAGE, capacity_pages=64, url=cluster.url, cluster=True,
                          key_prefix="ask", op_timeout_s=5.0) as store:  # fmt: skip
        first, slot = fresh_key(store, cluster)
        assert await store.put([first], data[:1]) == [True]  # stays on the old owner
        while True:  # a second new page in the same slot
            second = page_keys(np.arange(NS.page_tokens) + int.from_bytes(os.urandom(4)), NS)[0]
            if key_slot(store.page_name(second)) == slot:
                break
        old = owner(cluster, slot)
        new = next(n.port for n in cluster.nodes if n.port != old)
        ids = node_ids(cluster)
        with redis.Redis(port=new) as r:
            r.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[old])
        with redis.Redis(port=old) as r:
            r.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[new])
        try:
            assert await store.put([second], data[1:]) == [True]  # ASK -> the new node
            assert store.stats()["redirected_pages"] >= 1
            with redis.Redis(port=new) as r:
                assert r.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 1
            out = [np.zeros(PAGE, np.uint8) for _ in range(2)]
            assert await store.get([first, second], out) == [True, True]
            for o, d in zip(out, data, strict=True):
                np.testing.assert_array_equal(o, d)
        finally:
            for port in (old, new):
                with redis.Redis(port=port) as r:
                    r.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")


async def test_one_dead_master_costs_only_its_own_pages() -> None:
    """One master of three killed: the pages the two live masters hold are still served,
    byte-exact, and the dead one's are misses. A node that failed used to fail the whole
    batch, so every read spanning masters missed every page (0 of 64 served)."""
    reason = unavailable_reason("redis", cluster=True)
    if reason:
        pytest.skip(reason)
    rng = np.random.default_rng(11)
    with RedisClusterServers("redis") as cluster:
        async with RedisStore(page_bytes=PAGE, capacity_pages=256, url=cluster.url,
                              cluster=True, key_prefix="onedown", op_timeout_s=2.0,
                              batch_pages=64) as store:  # fmt: skip
            keys = page_keys(np.arange(48 * NS.page_tokens) + int.from_bytes(os.urandom(3)), NS)
            data = [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in keys]
            assert await store.put(keys, data) == [True] * 48
            ports = [owner(cluster, key_slot(store.page_name(k))) for k in keys]
            dead = cluster.nodes[1]
            assert 0 < ports.count(dead.port) < 48  # the read spans the dead and live nodes
            dead.kill()
            out = [np.zeros(PAGE, np.uint8) for _ in keys]
            hits = await store.get(keys, out)
            assert hits == [p != dead.port for p in ports]
            assert all(np.array_equal(o, d) for o, d, h in zip(out, data, hits, strict=True) if h)
            assert store.stats()["outages"] == 1  # the dead node is an outage of the store


def _skip_without_cluster() -> None:
    reason = unavailable_reason("redis", cluster=True)
    if reason:
        pytest.skip(reason)


def _store(cluster: RedisClusterServers, prefix: str, **options: Any) -> RedisStore:
    """A store on ``cluster`` holding up to 512 pages, under ``prefix``."""
    return RedisStore(page_bytes=PAGE, capacity_pages=512, url=cluster.url, cluster=True,
                      key_prefix=prefix, max_inflight=2, **options)  # fmt: skip


def _pages(seed: int, n: int) -> tuple[list[PageKey], list[np.ndarray]]:
    """``n`` fresh page keys (random tokens) and random page bytes for them."""
    rng = np.random.default_rng(seed)
    keys = page_keys(np.arange(n * NS.page_tokens) + int.from_bytes(os.urandom(3)), NS)
    return keys, [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in keys]


async def test_one_dead_master_costs_only_its_own_pages_over_many_batches() -> None:
    """A write and a read of many batches, with one master of three dead: every page the
    live masters own is stored and served, byte-exact. A batch touching the dead node used
    to count as a failed batch of the store, and the batches still waiting for a pipeline
    slot were skipped, live masters' pages included (the probe stored 23 of 47)."""
    _skip_without_cluster()
    with RedisClusterServers("redis") as cluster:
        async with _store(cluster, "manydown", op_timeout_s=2.0, batch_pages=4) as store:
            keys, data = _pages(12, 96)
            ports = [owner(cluster, key_slot(store.page_name(k))) for k in keys]
            dead = cluster.nodes[2]
            live = [p != dead.port for p in ports]
            assert 0 < live.count(False) < len(keys)
            assert await store.put(keys[:48], data[:48]) == [True] * 48
            dead.kill()
            t0 = time.monotonic()
            stored = await store.put(keys[48:], data[48:])
            assert stored == live[48:]
            out = [np.zeros(PAGE, np.uint8) for _ in keys]
            hits = await store.get(keys, out)
            assert time.monotonic() - t0 < 2 * 2.0  # a refused node costs no deadline
            assert hits == live
            assert all(np.array_equal(o, d) for o, d, h in zip(out, data, hits, strict=True) if h)
            assert store.stats()["outages"] >= 1


async def test_a_frozen_master_costs_one_deadline_and_only_its_own_pages() -> None:
    """One master frozen (SIGSTOP): every batch touching it timed out as a whole, so a
    read of 96 pages served none of them (0 of 96 in 1.0 s, and again 1.0 s on the next
    call). Each node's part of a batch now stops at the deadline by itself: the live
    masters' pages are served, and the frozen node is not asked again within
    ``op_timeout_s``, so the next call costs no deadline."""
    _skip_without_cluster()
    with RedisClusterServers("redis") as cluster:
        async with _store(cluster, "frozen", op_timeout_s=1.0, batch_pages=8) as store:
            keys, data = _pages(13, 96)
            assert await store.put(keys, data) == [True] * 96
            ports = [owner(cluster, key_slot(store.page_name(k))) for k in keys]
            frozen = cluster.nodes[1]
            live = [p != frozen.port for p in ports]
            frozen.pause()
            try:
                for bound in (2.0, 0.5):  # one deadline, then none
                    out = [np.zeros(PAGE, np.uint8) for _ in keys]
                    start = time.monotonic()
                    hits = await store.get(keys, out)
                    assert time.monotonic() - start < bound
                    assert hits == live
                    assert all(
                        np.array_equal(o, d) for o, d, h in zip(out, data, hits, strict=True) if h
                    )
            finally:
                frozen.resume()
