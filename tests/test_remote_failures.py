"""RedisStore when the server fails: each case uses a real server that is stopped, killed,
restarted, frozen, slowed down or out of memory.

What must hold every time: calls return within their deadline (no hang), failed pages are
misses (``False``/``None``), never wrong bytes, the client reconnects by itself, and an
outage is logged once when it starts and once when it ends. The one call that raises is
``contains`` (and ``exists``, built on it): "not committed" is a claim it cannot make
about a server that did not answer (``TierIOError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from kvtier.backends.remote import RedisStore

from kvtier.errors import TierIOError
from kvtier.keys import Namespace, PageKey, page_keys
from kvtier.testing.servers import RedisServer, free_port, unavailable_reason

PAGE = 16 * 1024
TIMEOUT = 0.5  # op_timeout_s of the stores under test
SLACK = 1.0  # scheduling slack on a loaded 2-core CI machine
NS = Namespace("failure-model")

pytestmark = pytest.mark.skipif(
    unavailable_reason("valkey") is not None, reason=str(unavailable_reason("valkey"))
)


def keys_for(n: int) -> list[PageKey]:
    return page_keys(np.arange(n * NS.page_tokens) + int.from_bytes(os.urandom(3)), NS)


def pages(n: int, size: int = PAGE) -> list[np.ndarray]:
    rng = np.random.default_rng(n)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def store(url: str, **options: object) -> RedisStore:
    opts: dict[str, object] = {"op_timeout_s": TIMEOUT, "connect_timeout_s": TIMEOUT}
    opts.update(options)
    page = int(opts.pop("page_bytes", PAGE))  # type: ignore[call-overload]
    cap = int(opts.pop("capacity_pages", 256))  # type: ignore[call-overload]
    return RedisStore(page_bytes=page, capacity_pages=cap, url=url, **opts)


def outage_lines(caplog: pytest.LogCaptureFixture) -> tuple[int, int]:
    """(outage-start lines, outage-end lines) logged by the remote store."""
    recs = [r for r in caplog.records if r.name == "kvtier.backends.remote"]
    down = sum("unavailable (" in r.getMessage() for r in recs)
    back = sum("is back after" in r.getMessage() for r in recs)
    return down, back


async def timed(coro):  # type: ignore[no-untyped-def]
    start = time.monotonic()
    result = await coro
    return result, time.monotonic() - start


def same(out: list[np.ndarray], data: list[np.ndarray], hits: list[bool]) -> bool:
    """Every page reported as a hit holds exactly the bytes that were stored."""
    return all(np.array_equal(o, d) for o, d, h in zip(out, data, hits, strict=True) if h)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer("valkey") as s:
        yield s


async def test_server_down_at_start_then_up(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kvtier.backends.remote")
    port = free_port()
    keys, data = keys_for(40), pages(40)
    async with store(f"redis://127.0.0.1:{port}/0", batch_pages=4) as s:
        for _ in range(3):  # several calls and 10 batches each: still one log line
            ok, took = await timed(s.put(keys, data))
            assert ok == [False] * 40 and took < TIMEOUT + SLACK
            with pytest.raises(TierIOError, match="no answer for 40 of 40 keys"):
                await s.exists(keys)
            assert await s.get(keys, [np.zeros(PAGE, np.uint8) for _ in keys]) == [False] * 40
        assert s.used_pages() == 0
        assert await s.keys() == []
        assert outage_lines(caplog) == (1, 0)
        with RedisServer("valkey", port=port):
            assert await s.put(keys, data) == [True] * 40
            out = [np.zeros(PAGE, np.uint8) for _ in keys]
            assert await s.get(keys, out) == [True] * 40 and same(out, data, [True] * 40)
        assert outage_lines(caplog) == (1, 1)
        assert s.stats()["outages"] == 1


async def test_killed_mid_run_and_restarted(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    keys, data = keys_for(30), pages(30)
    async with store(server.url, batch_pages=4) as s:
        assert await s.put(keys, data) == [True] * 30
        server.kill()
        out = [np.zeros(PAGE, np.uint8) for _ in keys]
        ok, took = await timed(s.get(keys, out))
        assert ok == [False] * 30 and took < TIMEOUT + SLACK
        with pytest.raises(TierIOError, match="no answer for 30 of 30 keys"):
            await s.contains(keys)
        assert await s.put(keys_for(2), pages(2)) == [False, False]
        server.start()  # same port, empty (no persistence)
        assert await s.get(keys, out) == [False] * 30  # reconnected; the data is gone
        assert await s.put(keys[:5], data[:5]) == [True] * 5
        assert await s.get(keys[:5], out[:5]) == [True] * 5 and same(out[:5], data[:5], [True] * 5)
        assert s.used_pages() == 5  # misses took the lost pages out of the count
    assert outage_lines(caplog) == (1, 1)


async def test_kill_during_large_transfers_never_serves_wrong_bytes(server: RedisServer) -> None:
    size = 1 << 20
    keys, data = keys_for(48), pages(48, size)
    async with store(server.url, page_bytes=size, batch_pages=2, max_inflight=2) as s:
        assert await s.put(keys, data) == [True] * 48
        out = [np.zeros(size, np.uint8) for _ in keys]
        reading = asyncio.create_task(s.get(keys, out))
        writing = asyncio.create_task(s.put(keys_for(48), data))
        await asyncio.sleep(0.01)
        server.kill()
        (hits, wrote), took = await timed(asyncio.gather(reading, writing))
        assert took < 2 * TIMEOUT + SLACK
        assert same(out, data, hits)
        assert not all(wrote) or not all(hits)  # the kill cut something short
        server.start()
        out2 = [np.zeros(size, np.uint8) for _ in keys]
        assert await s.get(keys, out2) == [False] * 48  # restarted empty: misses, no garbage


async def test_graceful_restart_reconnects(server: RedisServer) -> None:
    keys, data = keys_for(6), pages(6)
    async with store(server.url) as s:
        assert await s.put(keys, data) == [True] * 6
        server.restart()
        # the pooled connection is stale; the store reconnects without surfacing an error
        assert await s.contains(keys) == [False] * 6
        assert await s.put(keys, data) == [True] * 6
        assert await s.exists(keys) == 6


async def test_frozen_server_times_out_within_deadline(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    keys, data = keys_for(64), pages(64)
    # The pages are stored beforehand with a roomy deadline: a scheduling stall of more than
    # TIMEOUT on a loaded 2-core machine once failed this set-up (and logged an outage)
    # before the server was ever frozen.
    async with store(server.url, op_timeout_s=30.0, connect_timeout_s=30.0) as filler:
        assert await filler.put(keys, data) == [True] * 64
    async with store(server.url, batch_pages=4, max_inflight=2) as s:
        assert await s.contains(keys[:1]) == [True]  # one round trip: a connection open
        server.pause()  # SIGSTOP: connections stay open, nothing answers
        try:
            out = [np.zeros(PAGE, np.uint8) for _ in keys]
            for call in (s.get(keys, out), s.put(keys_for(8), pages(8))):
                res, took = await timed(call)
                assert not any(res) and took < TIMEOUT + SLACK, (res, took)
            start = time.perf_counter()
            with pytest.raises(TierIOError, match="no answer"):
                await s.contains(keys)
            assert time.perf_counter() - start < TIMEOUT + SLACK
        finally:
            server.resume()
        out = [np.zeros(PAGE, np.uint8) for _ in keys]
        hits = await s.get(keys, out)
        assert hits == [True] * 64 and same(out, data, hits)
    assert outage_lines(caplog) == (1, 1)


async def test_frozen_server_concurrent_calls_each_miss_within_deadline(
    server: RedisServer,
) -> None:
    """More calls than ``max_inflight`` while the server is frozen: calls queued behind the
    failing ones must not each wait out a deadline of their own in turn."""
    keys, data = keys_for(8), pages(8)
    async with store(server.url, max_inflight=2) as s:
        assert await s.put(keys, data) == [True] * 8
        outs = [np.zeros(PAGE, np.uint8) for _ in keys]
        server.pause()
        try:
            calls = [timed(s.get([k], [o])) for k, o in zip(keys, outs, strict=True)]
            results = await asyncio.gather(*calls)
        finally:
            server.resume()
        for hits, took in results:
            assert hits == [False] and took < TIMEOUT + SLACK, results
        hits = await s.get(keys, outs)
        assert hits == [True] * 8 and same(outs, data, hits)


async def test_slow_server_debug_sleep(server: RedisServer) -> None:
    keys, data = keys_for(8), pages(8)
    admin = redis.asyncio.Redis(port=server.port)
    async with store(server.url) as s:
        assert await s.put(keys, data) == [True] * 8
        sleeper = asyncio.create_task(admin.execute_command("DEBUG", "SLEEP", 2 * TIMEOUT + 0.5))
        await asyncio.sleep(0.1)
        out = [np.zeros(PAGE, np.uint8) for _ in keys]
        hits, took = await timed(s.get(keys, out))
        assert hits == [False] * 8 and took < TIMEOUT + SLACK
        await sleeper
        hits = await s.get(keys, out)
        assert hits == [True] * 8 and same(out, data, hits)
    await admin.aclose()


async def test_client_pause_then_recovery(server: RedisServer) -> None:
    keys, data = keys_for(8), pages(8)
    admin = redis.Redis(port=server.port)
    async with store(server.url) as s:
        admin.client_pause(int((2 * TIMEOUT + 0.5) * 1000), all=True)
        res, took = await timed(s.put(keys, data))
        assert res == [False] * 8 and took < TIMEOUT + SLACK
        await asyncio.sleep(2 * TIMEOUT + 0.6)
        assert await s.put(keys, data) == [True] * 8
        out = [np.zeros(PAGE, np.uint8) for _ in keys]
        assert await s.get(keys, out) == [True] * 8 and same(out, data, [True] * 8)
    admin.close()


async def test_out_of_memory_noeviction(caplog: pytest.LogCaptureFixture) -> None:
    size = 64 * 1024
    with RedisServer("valkey", maxmemory="4mb", maxmemory_policy="noeviction") as server:
        keys, data = keys_for(120), pages(120, size)  # 7.5 MiB: twice what fits
        async with store(server.url, page_bytes=size, batch_pages=8) as s:
            stored: list[bool] = []
            for i in range(0, 120, 8):  # many batches, each refused in part or whole
                stored += await s.put(keys[i : i + 8], data[i : i + 8])
            assert any(stored) and not all(stored)
            out = [np.zeros(size, np.uint8) for _ in keys]
            hits = await s.get(keys, out)
            assert hits == stored and same(out, data, hits)  # nothing committed was lost
            assert s.used_pages() == sum(stored)
            assert s.stats()["refused_writes"] == stored.count(False)
            on_server = redis.Redis(port=server.port).keys(b"*")
            assert len(on_server) == sum(stored)  # refused writes left nothing behind
            # freeing memory lets writes through again
            assert all(await s.delete([k for k, ok in zip(keys, stored, strict=True) if ok]))
            assert await s.put(keys[-4:], data[-4:]) == [True] * 4
    refusals = [r for r in caplog.records if "refuses writes" in r.getMessage()]
    assert len(refusals) == 1 and "maxmemory" in refusals[0].getMessage()
    assert outage_lines(caplog) == (0, 0)  # a full server is not an outage: reads worked


async def test_server_evicting_keys_on_its_own() -> None:
    size = 64 * 1024
    with RedisServer("valkey", maxmemory="4mb", maxmemory_policy="allkeys-lru") as server:
        keys, data = keys_for(160), pages(160, size)  # 10 MiB through a 4 MiB server
        async with store(server.url, page_bytes=size, capacity_pages=1000) as s:
            stored: list[bool] = []
            for i in range(0, 160, 16):
                stored += await s.put(keys[i : i + 16], data[i : i + 16])
            assert sum(stored) > 100  # writes are accepted; old pages make room
            out = [np.zeros(size, np.uint8) for _ in keys]
            hits = await s.get(keys, out)
            assert 0 < sum(hits) < 160  # evicted pages are misses
            assert same(out, data, hits)  # survivors are byte-exact
            assert s.used_pages() == sum(hits)  # misses left the client-side count
            assert s.stats()["checksum_failures"] == 0


async def test_fail_fast_during_an_outage_with_a_retry_interval(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``retry_interval_s``, only the first call of a frozen server's outage waits for
    its deadline; the next calls miss at once; after the interval one probe finds the
    server back and pages are served again, byte-exact."""
    caplog.set_level(logging.INFO, "kvtier.backends.remote")
    keys, data = keys_for(8), pages(8)
    async with store(server.url, batch_pages=4, retry_interval_s=0.3) as s:
        assert await s.put(keys, data) == [True] * 8
        out = [np.zeros(PAGE, np.uint8) for _ in keys]
        server.pause()
        try:
            ok, first = await timed(s.get(keys, out))
            assert ok == [False] * 8 and TIMEOUT * 0.8 <= first < TIMEOUT + SLACK
            for _ in range(3):  # inside the retry interval: no deadline paid
                ok, took = await timed(s.get(keys, out))
                assert ok == [False] * 8 and took < 0.2
            assert s.stats()["skipped_batches"] >= 6
        finally:
            server.resume()
        await asyncio.sleep(0.4)  # past the interval: the next batch is a probe
        hits = await s.get(keys, out)
        assert hits[:4] == [True] * 4  # the probe batch (the rest may miss with it)
        assert await s.get(keys, out) == [True] * 8 and same(out, data, [True] * 8)
    assert outage_lines(caplog) == (1, 1)


def test_retry_interval_option_is_checked() -> None:
    with pytest.raises(Exception, match="retry_interval_s"):
        store("redis://127.0.0.1:1/0", retry_interval_s=-1)
    assert store("redis://127.0.0.1:1/0").options.retry_interval_s == 0.0  # off by default


def test_health_lets_one_probe_through_per_interval_and_backs_off(monkeypatch) -> None:
    from kvtier import health as remote_health

    now = [100.0]
    monkeypatch.setattr(remote_health.time, "monotonic", lambda: now[0])
    h = remote_health.Health("test", logging.getLogger("test"), retry_interval_s=1.0)
    assert h.may_send()  # healthy
    h.failed("boom")
    h.failed("boom")  # the same wave failing: the schedule does not change
    assert not h.may_send()
    now[0] += 1.0
    assert h.may_send()  # the probe
    assert not h.may_send()  # one probe at a time
    h.failed("still down")  # a failed probe doubles the wait
    now[0] += 1.5
    assert not h.may_send()
    now[0] += 0.5
    assert h.may_send()
    h.succeeded()
    assert h.may_send() and h.may_send()  # healthy again: everything goes
    assert h.skipped_batches == 3


def test_a_picked_port_taken_before_the_start_is_replaced_and_a_given_one_is_not() -> None:
    """CI failure (2026-12-04): another process bound the port ``free_port`` had picked
    before the server did, and the server exited with "Address already in use"."""
    import socket

    server = RedisServer("valkey")
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with server:
            assert server.port != taken
            assert redis.Redis(port=server.port).ping()
        given = RedisServer("valkey", port=taken)
        with pytest.raises(RuntimeError, match="Address already in use"):
            given.start()
        given.close()


def test_a_flapping_connection_logs_one_outage_per_quiet_period(monkeypatch, caplog) -> None:
    """A connection cut every 3 ms (a fault-injection run) logged an "unavailable" and a
    "back" line per cut: 495 pairs in 12 s. An outage opening within FLAP_QUIET_S of a
    logged recovery is counted and logged only if it lasts; the next line says how many
    went unlogged. Every outage still counts in ``outages``."""
    from kvtier import health as remote_health

    now = [100.0]
    monkeypatch.setattr(remote_health.time, "monotonic", lambda: now[0])
    log = logging.getLogger("test.flaps")
    h = remote_health.Health("test", log)

    def lines() -> tuple[int, int]:
        msgs = [r.getMessage() for r in caplog.records if r.name == "test.flaps"]
        return sum("unavailable (" in m for m in msgs), sum("is back after" in m for m in msgs)

    with caplog.at_level(logging.WARNING, logger="test.flaps"):
        for _ in range(4000):  # 12 s of a cut every 3 ms
            h.failed("connection reset")
            now[0] += 0.001
            h.succeeded()
            now[0] += 0.002
        assert h.outages == 4000
        assert lines() == (2, 2)  # at 0 s and once the quiet period after the first "back"
        msgs = [r.getMessage() for r in caplog.records if "unavailable (" in r.getMessage()]
        assert "not logged" not in msgs[0]
        unlogged = re.search(r"; (\d+) short outage\(s\) after a recovery were not logged", msgs[1])
        assert unlogged and 3300 <= int(unlogged[1]) <= 3340  # 10 s of 3 ms cuts

        h.failed("connection refused")  # a flap that lasts: logged once it has
        now[0] += 5.0
        h.failed("connection refused")
        assert lines() == (2, 2)
        now[0] += 5.0
        h.failed("connection refused")
        assert lines() == (3, 2)
        h.succeeded()
        assert lines() == (3, 3)
        now[0] += 60.0
        h.failed("timeout")  # long after the last recovery: logged at once
        assert lines() == (4, 3)


async def test_a_port_that_answers_no_redis_protocol_is_named(caplog) -> None:
    """Something else listening at the pool's address, answering a bulk string to every
    command: the outage line said only "AttributeError: 'bytes' object has no attribute
    'get'" (the client's parser); it now says the reply is not Redis protocol."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while conn.recv(65536):
                conn.sendall(b"$5\r\nhello\r\n")

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.backends.remote"):
            async with store(f"redis://127.0.0.1:{port}/0") as s:
                keys = keys_for(2)
                with pytest.raises(TierIOError, match="no answer for 2 of 2 keys"):
                    await s.contains(keys)  # the first call opens the outage
        lines = [r.getMessage() for r in caplog.records if "unavailable (" in r.getMessage()]
        assert lines and "reply is not Redis protocol" in lines[0], lines
    finally:
        listener.close()


async def test_a_page_over_the_servers_bulk_limit_is_named_not_only_a_reset(caplog) -> None:
    """A server whose ``proto-max-bulk-len`` is below the page value closes the connection
    mid-send: the outage line said only "send failed: [Errno 104] Connection reset by
    peer", as if the server were down. It now quotes the error the server sent first and
    says what it means."""
    reason = unavailable_reason("redis")
    if reason:
        pytest.skip(reason)
    page = 4 << 20
    with (
        RedisServer("redis", extra=["--proto-max-bulk-len", "1mb"]) as server,
        caplog.at_level(logging.WARNING, logger="kvtier.backends.remote"),
    ):
        async with store(server.url, page_bytes=page, capacity_pages=8) as s:
            pages = [np.ones(page, np.uint8) for _ in range(4)]
            assert await s.put(keys_for(4), pages) == [False] * 4
    lines = [r.getMessage() for r in caplog.records if "unavailable (" in r.getMessage()]
    assert lines, [r.getMessage() for r in caplog.records]
    assert "the server said: ERR Protocol error: invalid bulk length" in lines[0], lines
    assert "larger than the server's proto-max-bulk-len" in lines[0]
