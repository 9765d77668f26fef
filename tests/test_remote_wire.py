"""The remote store's own RESP data path against a real Valkey server.

``WireConnection`` (one blocking connection: replies, values read straight into the
caller's buffers, deadlines, abort) and ``WirePool`` / ``send_pages`` / ``fetch_pages``
(batches on worker threads, cancellation that leaves no thread writing into a buffer).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from kvtier.backends.remote_datapath import (
    Fetched,
    GetItem,
    SetItem,
    WirePool,
    WireSettings,
    byte_view,
    fetch_pages,
    send_pages,
    set_suffix,
)
from kvtier.backends.remote_wire import (
    AuthenticationError,
    ReplyError,
    ValueReply,
    WireConnection,
    WireError,
    WireTimeout,
    command,
)

from kvtier.pageformat import encode_header
from kvtier.testing.servers import RedisServer, free_port, unavailable_reason

pytestmark = pytest.mark.skipif(
    unavailable_reason("valkey") is not None, reason=str(unavailable_reason("valkey"))
)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer("valkey") as s:
        yield s


@pytest.fixture
def raw(server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=server.port)
    yield client
    client.close()


def connect(server: RedisServer, deadline_s: float = 5.0, **kw: object) -> WireConnection:
    return WireConnection.connect(
        "127.0.0.1", server.port, deadline=time.monotonic() + deadline_s,
        connect_timeout_s=1.0, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_replies_of_every_type(server: RedisServer) -> None:
    conn = connect(server)
    conn.send([command(b"SET", b"a", b"xyz"), command(b"GET", b"a"), command(b"GET", b"none"),
               command(b"INCR", b"n"), command(b"RPUSH", b"l", b"1", b"2"),
               command(b"LRANGE", b"l", b"0", b"-1"), command(b"INCR", b"a")])  # fmt: skip
    assert conn.read_reply() == b"OK"
    assert conn.read_reply() == b"xyz"
    assert conn.read_reply() is None
    assert conn.read_reply() == 1
    assert conn.read_reply() == 2
    assert conn.read_reply() == [b"1", b"2"]
    err = conn.read_reply()
    assert isinstance(err, ReplyError) and err.prefix == "ERR" and not err.redirected
    assert not conn.broken
    conn.close()


def test_values_land_in_the_callers_buffers_and_the_stream_stays_in_step(
    server: RedisServer, raw: redis.Redis
) -> None:
    """A value of the expected size goes to the caller's buffers; nil, a value of another
    size and an error reply leave them untouched, and the replies after them still parse."""
    size = 10_000
    payload = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    raw.set("good", payload.tobytes() + b"H" * 16)
    raw.set("short", b"tiny")
    raw.rpush("list", b"x")
    conn = connect(server)
    names = [b"good", b"missing", b"short", b"list", b"good"]
    conn.send([command(b"GET", n) for n in names])
    outs = [np.zeros(size, np.uint8) for _ in names]
    trailers = [bytearray(16) for _ in names]
    got = [conn.read_value_into(byte_view(o), memoryview(t))
           for o, t in zip(outs, trailers, strict=True)]  # fmt: skip
    assert got[0] is ValueReply.VALUE and got[4] is ValueReply.VALUE
    assert got[1] is ValueReply.NIL and got[2] is ValueReply.WRONG_SIZE
    assert isinstance(got[3], ReplyError) and got[3].prefix == "WRONGTYPE"
    for i in (0, 4):
        np.testing.assert_array_equal(outs[i], payload)
        assert trailers[i] == b"H" * 16
    for i in (1, 2, 3):
        assert not outs[i].any() and not any(trailers[i])
    conn.send([command(b"PING")])
    assert conn.read_reply() == b"PONG"
    conn.close()


def test_read_blob_into_takes_values_up_to_the_buffers(
    server: RedisServer, raw: redis.Redis
) -> None:
    """A value of one byte more than the trailer up to both buffers full is split into
    payload (its start) and trailer; nil, an empty payload, a value too long and an error
    reply leave the buffers untouched, and the replies after them still parse."""
    largest = 5000
    rng = np.random.default_rng(3)
    values = {b"one": 1, b"some": 777, b"full": largest}
    for name, n in values.items():
        raw.set(name, rng.integers(0, 256, n + 16, dtype=np.uint8).tobytes())
    raw.set("header-only", b"H" * 16)
    raw.set("too-long", b"x" * (largest + 17))
    raw.rpush("list", b"x")
    names = [*values, b"missing", b"header-only", b"too-long", b"list", b"some"]
    conn = connect(server)
    conn.send([command(b"GET", n) for n in names])
    outs = [np.zeros(largest, np.uint8) for _ in names]
    trailers = [bytearray(16) for _ in names]
    got = [conn.read_blob_into(byte_view(o), memoryview(t))
           for o, t in zip(outs, trailers, strict=True)]  # fmt: skip
    assert got[:3] == [1, 777, largest] and got[7] == 777
    assert got[3] is ValueReply.NIL
    assert got[4] is ValueReply.WRONG_SIZE and got[5] is ValueReply.WRONG_SIZE
    assert isinstance(got[6], ReplyError) and got[6].prefix == "WRONGTYPE"
    for i, name in enumerate(names):
        if isinstance(got[i], int):
            n = got[i]
            assert bytes(outs[i][:n]) + bytes(trailers[i]) == raw.get(name)
            assert not outs[i][n:].any()  # nothing past the value
        else:
            assert not outs[i].any() and not any(trailers[i])
    conn.send([command(b"PING")])
    assert conn.read_reply() == b"PONG"
    conn.close()


def test_many_small_values_through_the_line_buffer(server: RedisServer, raw: redis.Redis) -> None:
    """Small pipelined values arrive several per receive: they are served from the
    connection's buffer, byte-exact."""
    values = [bytes([i]) * (50 + i) for i in range(200)]
    for i, v in enumerate(values):
        raw.set(f"k{i}", v)
    conn = connect(server)
    conn.send([command(b"GET", f"k{i}".encode()) for i in range(200)])
    for v in values:
        out, trailer = bytearray(len(v) - 1), bytearray(1)
        assert conn.read_value_into(memoryview(out), memoryview(trailer)) is ValueReply.VALUE
        assert bytes(out + trailer) == v
    conn.close()


def test_a_frozen_server_times_out_at_the_deadline(server: RedisServer) -> None:
    conn = connect(server)
    server.pause()
    try:
        conn.deadline = time.monotonic() + 0.3
        start = time.monotonic()
        conn.send([command(b"PING")])
        with pytest.raises(WireTimeout):
            conn.read_reply()
        assert 0.25 < time.monotonic() - start < 1.5
        assert conn.broken
        with pytest.raises(WireTimeout):  # past its deadline, nothing more is tried
            conn.send([command(b"PING")])
    finally:
        server.resume()
        conn.close()


def test_abort_from_another_thread_ends_a_blocked_read(server: RedisServer) -> None:
    conn = connect(server, deadline_s=30)
    server.pause()
    try:
        timer = threading.Timer(0.2, conn.abort)
        timer.start()
        start = time.monotonic()
        conn.send([command(b"PING")])
        with pytest.raises(WireError):
            conn.read_reply()
        assert time.monotonic() - start < 5
    finally:
        server.resume()
        conn.close()


def test_connection_failures_are_wire_errors(server: RedisServer) -> None:
    with pytest.raises(WireError, match="connecting"):
        WireConnection.connect("127.0.0.1", free_port(), deadline=time.monotonic() + 2,
                               connect_timeout_s=1.0)  # fmt: skip
    conn = connect(server)
    server.kill()
    with pytest.raises(WireError):
        conn.send([command(b"PING")])
        conn.read_reply()
    assert conn.broken


def test_refused_credentials_are_an_authentication_error() -> None:
    if unavailable_reason("redis"):
        pytest.skip(str(unavailable_reason("redis")))
    with RedisServer("redis", password="secret") as server:
        with pytest.raises(AuthenticationError, match="Authentication"):
            connect(server, password="wrong")
        conn = connect(server, password="secret", db=3)
        conn.send([command(b"SET", b"k", b"v")])
        assert conn.read_reply() == b"OK"
        conn.close()
        assert redis.Redis(port=server.port, password="secret", db=3).get("k") == b"v"


def test_send_and_fetch_pages_write_the_page_format_and_verify_it(
    server: RedisServer, raw: redis.Redis
) -> None:
    size = 64 * 1024
    pages = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(5)]
    keys = [bytes([i]) * 16 for i in range(5)]
    names = [b"p:%d" % i for i in range(5)]
    conn = connect(server)
    items = [SetItem(n, byte_view(p), k, "ns") for n, p, k in zip(names, pages, keys, strict=True)]
    assert send_pages(conn, items, nx=True, ttl_ms=0) == [True] * 5
    assert send_pages(conn, items[:1], nx=True, ttl_ms=0) == [None]  # NX: already there
    stored = raw.get(names[0])
    assert stored == pages[0].tobytes() + encode_header(keys[0], "ns", pages[0])
    raw.setrange(names[1], 100, b"\xff\xfe")  # corrupt the payload
    raw.set(names[2], b"foreign")  # not a page
    raw.delete(names[3])
    outs = [np.zeros(size, np.uint8) for _ in range(6)]
    gets = zip([*names, names[4]], [*keys, keys[0]], outs, strict=True)
    got = fetch_pages(conn, [GetItem(n, k, byte_view(o)) for n, k, o in gets])
    assert [g[0] for g in got if not isinstance(g, ReplyError)] == [
        Fetched.HIT,
        Fetched.BAD,
        Fetched.BAD,
        Fetched.ABSENT,
        Fetched.HIT,
        Fetched.BAD,
    ]  # the last: page 4's bytes under page 0's key
    assert "checksum" in got[1][1] and "size" in got[2][1] and "key" in got[5][1]  # type: ignore[index]
    for i in (0, 4):
        np.testing.assert_array_equal(outs[i], pages[i])
    conn.close()


def test_fetch_pages_sized_reads_and_verifies_short_blobs(
    server: RedisServer, raw: redis.Redis
) -> None:
    """Blobs shorter than a page, sent with their header, come back with their length
    when ``sized``; without it they are ``BAD`` (a page store takes whole pages only)."""
    size = 4096
    rng = np.random.default_rng(4)
    blobs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 100, size)]
    keys = [bytes([i]) * 16 for i in range(3)]
    names = [b"b:%d" % i for i in range(3)]
    conn = connect(server)
    items = [SetItem(n, byte_view(b), k, "ns") for n, b, k in zip(names, blobs, keys, strict=True)]
    assert send_pages(conn, items, nx=False, ttl_ms=0) == [True] * 3
    raw.setrange(names[2], 7, b"\x00\x01")  # corrupt the full-size one
    outs = [np.zeros(size, np.uint8) for _ in range(4)]
    gets = [GetItem(n, k, byte_view(o)) for n, k, o in
            zip([*names, b"b:none"], [*keys, keys[0]], outs, strict=True)]  # fmt: skip
    got = fetch_pages(conn, gets, sized=True)
    assert got[:2] == [(Fetched.HIT, "", 1), (Fetched.HIT, "", 100)]
    assert got[3] == (Fetched.ABSENT, "", 0)
    assert not isinstance(got[2], ReplyError) and got[2][0] is Fetched.BAD
    assert "checksum" in got[2][1]
    for i in (0, 1):
        np.testing.assert_array_equal(outs[i][: blobs[i].nbytes], blobs[i])
    plain = fetch_pages(conn, gets[:2])
    assert [g[0] for g in plain if not isinstance(g, ReplyError)] == [Fetched.BAD] * 2
    conn.close()


def test_set_suffix_encodes_nx_and_ttl() -> None:
    assert set_suffix(False, 0) == (3, b"")
    assert set_suffix(True, 1500) == (6, b"$2\r\nNX\r\n$2\r\nPX\r\n$4\r\n1500\r\n")


async def test_pool_reuses_connections_and_drops_stale_ones(server: RedisServer) -> None:
    pool = WirePool(WireSettings(connect_timeout_s=1.0), threads=2)
    address = ("127.0.0.1", server.port)

    def ping(conn: WireConnection) -> object:
        conn.send([command(b"PING")])
        return conn.read_reply()

    try:
        for _ in range(3):
            assert await pool.run(address, ping, time.monotonic() + 2) == b"PONG"
        assert pool.connects == 1
        server.restart()  # the idle connection is now closed by the server
        assert await pool.run(address, ping, time.monotonic() + 2) == b"PONG"
        assert pool.connects == 2
        with pytest.raises(WireError):
            await pool.run(("127.0.0.1", free_port()), ping, time.monotonic() + 2)
    finally:
        pool.close()
    with pytest.raises(WireError, match="closed"):
        await pool.run(address, ping, time.monotonic() + 2)


async def test_a_cancelled_fetch_leaves_no_thread_writing_into_the_buffer(
    server: RedisServer, raw: redis.Redis
) -> None:
    """The caller is cancelled while its batch waits on a frozen server; once the call has
    returned, the server's late reply must not reach the caller's buffer."""
    size = 256 * 1024
    page = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    key = b"K" * 16
    raw.set(b"late", page.tobytes() + encode_header(key, "", page))
    pool = WirePool(WireSettings(connect_timeout_s=1.0), threads=1)
    out = np.zeros(size, np.uint8)
    items = [GetItem(b"late", key, byte_view(out))]
    try:
        server.pause()
        deadline = time.monotonic() + 30
        task = asyncio.create_task(
            pool.run(("127.0.0.1", server.port), lambda c: fetch_pages(c, items), deadline)
        )
        await asyncio.sleep(0.3)  # the thread is blocked reading
        task.cancel()
        start = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - start < 5
        server.resume()
        await asyncio.sleep(0.3)  # a late reply would have landed by now
        assert not out.any()
    finally:
        server.resume()
        pool.close()
