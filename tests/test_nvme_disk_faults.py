"""The NVMe tier when its file system fails under it: full, read-only, I/O errors.

No root or mount needed: the failures are injected where the store meets the OS
(``os.posix_fallocate``, SQLite's connection, the index transaction).

* Reopening a healthy store on a full disk is not "not a kvtier store index": it is
  :class:`StoreUnavailableError` naming the path, SQLite's error and the free space, the
  tier is skipped and nothing in the store changes (F1).
* A tier that fails, works, fails... logs one warning per outage, not per flap (F2).
* A slab file that cannot be allocated, or an index transaction that fails, marks the tier
  failing instead of making it look full, and the tier recovers when space returns (F4).
* ``inspect store`` calls an empty index beside slabs damage (exit 1), as opening the
  store does by rebuilding it (F8).
"""

from __future__ import annotations

import errno
import hashlib
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from cache_kit import PAGE as TINY_PAGE
from cache_kit import open_cache, tier
from kvtier.backends.nvme import NvmeStore
from kvtier.backends.nvme_index import (
    INDEX_FILE,
    DamagedStoreError,
    NotAStoreError,
    StoreIndex,
    StoreUnavailableError,
)
from kvtier.backends.nvme_inspect import inspect_store
from kvtier.backends.nvme_layout import BLOCK
from kvtier.backends.nvme_rebuild import rebuild_index
from kvtier.cli.app import get_app
from structlog.testing import capture_logs
from typer.testing import CliRunner

from kvtier.errors import KVTierUsageError, TierIOError, TierOpenError, TierOpenUsageError
from kvtier.index.directory import PageState
from kvtier.keys import PageKey
from kvtier.transfer.tier import Tier

PAGE = 2 * BLOCK
SLAB = 4 * (PAGE + BLOCK)  # 4 slots per slab: new slabs are needed often


def key(i: int) -> PageKey:
    return PageKey(i.to_bytes(16, "little"))


def page(i: int, nbytes: int = PAGE) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def store(path: Path, capacity: int = 64, **opts: Any) -> NvmeStore:
    opts.setdefault("slab_bytes", SLAB)
    return NvmeStore(page_bytes=PAGE, capacity_pages=capacity, path=path, **opts)


def digest(root: Path) -> dict[str, str]:
    """Every file of the store (index, slabs) by content hash: what "unchanged" means."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != "lock":
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def sqlite_error(message: str, code: int) -> sqlite3.OperationalError:
    """An SQLite error as the module raises it (with its result code)."""
    exc = sqlite3.OperationalError(message)
    exc.sqlite_errorcode = code  # type: ignore[attr-defined]
    return exc


class _FailingDb:
    """A connection whose statements starting with ``prefix`` raise ``exc``."""

    def __init__(self, db: sqlite3.Connection, prefix: str, exc: Exception) -> None:
        self._db, self._prefix, self._exc = db, prefix, exc

    def execute(self, sql: str, *args: Any) -> Any:
        if sql.lstrip().upper().startswith(self._prefix):
            raise self._exc
        return self._db.execute(sql, *args)

    def executemany(self, sql: str, *args: Any) -> Any:
        if sql.lstrip().upper().startswith(self._prefix):
            raise self._exc
        return self._db.executemany(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def fail_sqlite(monkeypatch: pytest.MonkeyPatch, prefix: str, exc: Exception) -> None:
    """Make every new SQLite connection raise ``exc`` on statements starting ``prefix``."""
    real = sqlite3.connect

    def connect(*args: Any, **kwargs: Any) -> Any:
        return _FailingDb(real(*args, **kwargs), prefix, exc)

    monkeypatch.setattr(sqlite3, "connect", connect)


async def make_store(root: Path, n: int = 6) -> None:
    async with store(root) as s:
        assert await s.put([key(i) for i in range(n)], [page(i) for i in range(n)]) == [True] * n


async def check_pages(root: Path, n: int = 6) -> None:
    async with store(root) as s:
        outs = [np.empty(PAGE, np.uint8) for _ in range(n)]
        assert await s.get([key(i) for i in range(n)], outs) == [True] * n
        for i, out in enumerate(outs):
            np.testing.assert_array_equal(out, page(i))


# -- F1: reopening on a full disk -----------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "exc", "doing"),
    [
        ("PRAGMA JOURNAL_MODE", sqlite_error("disk I/O error", 10), "open"),  # SQLITE_IOERR
        ("INSERT OR REPLACE INTO META", sqlite_error("database or disk is full", 13), "update"),
        ("PRAGMA JOURNAL_MODE", sqlite3.OperationalError("unable to open database file"), "open"),
    ],
)
async def test_reopen_on_a_full_disk_is_not_called_not_a_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefix: str, exc: Exception, doing: str
) -> None:
    """The index of a healthy store that SQLite cannot open or update (full disk, I/O
    error) was reported as "not a kvtier store index" (NotAStoreError, a usage error) or
    as a bare OperationalError: an operator could wipe a healthy store."""
    root = tmp_path / "s"
    await make_store(root)
    before = digest(root)
    fail_sqlite(monkeypatch, prefix, exc)
    with pytest.raises(StoreUnavailableError) as info:
        await store(root).open()
    message = str(info.value)
    assert not isinstance(info.value, NotAStoreError | KVTierUsageError)
    assert f"cannot {doing} the index {root / INDEX_FILE}: {exc}" in message
    assert "free" in message and "the store itself was not judged" in message
    assert "not a kvtier store index" not in message
    monkeypatch.undo()
    assert digest(root) == before  # nothing in the store changed
    await check_pages(root)  # and it serves every page once the disk is back


async def test_a_cache_skips_the_tier_and_fail_mode_raises_a_runtime_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tier is still skipped (misses), under the right name; with ``fail`` the error
    is a runtime TierOpenError (exit 1), not a usage error (exit 2)."""
    root = tmp_path / "nvme"
    nvme = tier("nvme", "nvme", 32, options={"path": str(root), "slab_bytes": 4 * 4096})
    cfg: dict[str, Any] = {"model": {"preset": "tiny"}, "tiers": [tier("dram", "dram", 8), nvme]}
    async with open_cache(cfg) as cache:
        await cache.store(np.arange(16), np.zeros((4, TINY_PAGE), np.uint8))
        await cache.flush()
    before = digest(root)
    fail_sqlite(monkeypatch, "PRAGMA JOURNAL_MODE", sqlite_error("disk I/O error", 10))
    async with open_cache(cfg) as cache:
        why = cache.skipped_tiers["nvme"]
        assert why.startswith("StoreUnavailableError: cannot open the index")
        assert "disk I/O error" in why and "free" in why
    nvme["on_open_error"] = "fail"
    cache = open_cache(cfg)
    with pytest.raises(TierOpenError, match="disk I/O error") as info:
        await cache.start()
    assert not isinstance(info.value, TierOpenUsageError)
    monkeypatch.undo()
    assert digest(root) == before


async def test_an_index_that_is_not_a_database_is_still_refused_by_name(tmp_path: Path) -> None:
    root = tmp_path / "s"
    await make_store(root)
    (root / INDEX_FILE).write_bytes(os.urandom(8192))
    with pytest.raises(NotAStoreError, match="is not a kvtier store index"):
        await store(root).open()


# -- F2: one warning per outage, not per flap -----------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Clock]:
    c = _Clock()
    monkeypatch.setattr(time, "monotonic", c.monotonic)  # what tiers read their time from
    yield c


def bare_tier() -> Tier:
    config = SimpleNamespace(
        name="nvme", backend="nvme", eviction="lru", high_watermark=0.9, low_watermark=0.8
    )
    backend = SimpleNamespace(capacity_pages=100, kind="store")
    return Tier(1, config, backend, None)  # type: ignore[arg-type]


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"].startswith(name)]


def test_a_flapping_tier_logs_one_warning_per_outage(clock: _Clock) -> None:
    """A full disk that takes some writes and refuses the next logged 583 warnings and
    582 "recovered" lines in 6 s; now one warning, and one recovery line once the tier
    has worked for ``recovery_quiet_s`` seconds."""
    t = bare_tier()
    with capture_logs() as logs:
        for _ in range(200):
            t.record_failure("write", 8)
            assert not t.healthy  # failing now: its pages are misses
            clock.now += 0.003
            t.record_success()
            assert t.healthy  # the last call worked
            clock.now += 0.003
        assert len(events(logs, "tier failing")) == 1
        assert events(logs, "tier recovered") == []
        assert t.in_outage and t.outages == 1 and t.describe()["outage_open"]
        clock.now += t.recovery_quiet_s
        t.record_success()
    (recovered,) = events(logs, "tier recovered")
    assert recovered["failed_pages"] == 1600 and recovered["relapses"] == 199
    assert recovered["outage_s"] == pytest.approx(199 * 0.006 + 0.003, abs=1e-3)
    assert not t.in_outage and t.describe()["outages"] == 1
    with capture_logs() as logs:  # a failure after the quiet period is a new outage
        t.record_failure("get", 1)
    assert len(events(logs, "tier failing")) == 1 and t.outages == 2


def test_a_failure_after_a_quiet_idle_period_ends_the_old_outage_first(clock: _Clock) -> None:
    t = bare_tier()
    with capture_logs() as logs:
        t.record_failure("write", 2)
        clock.now += 1
        t.record_success()  # worked, then nothing for longer than the quiet period
        clock.now += t.recovery_quiet_s + 1
        t.record_failure("write", 3)
    assert [e["event"] for e in logs if e["event"].startswith("tier")] == [
        "tier failing: its pages are treated as misses",
        "tier recovered",
        "tier failing: its pages are treated as misses",
    ]
    assert events(logs, "tier recovered")[0]["failed_pages"] == 2 and t.outages == 2


def test_a_tier_that_keeps_failing_logs_once_until_it_works(clock: _Clock) -> None:
    t = bare_tier()
    with capture_logs() as logs:
        for _ in range(50):
            t.record_failure("get", 1)
            clock.now += 1.0  # failing steadily, longer than the quiet period in all
        t.record_success()
        assert events(logs, "tier recovered") == []  # it must work for a while first
        clock.now += t.recovery_quiet_s
        t.record_success()
    assert len(events(logs, "tier failing")) == 1
    (recovered,) = events(logs, "tier recovered")
    assert recovered["failed_pages"] == 50 and recovered["relapses"] == 0


# -- F4: a failing medium marks the tier failing, it does not make it look full --------------


def refuse_space(monkeypatch: pytest.MonkeyPatch, code: int = errno.ENOSPC) -> None:
    def fallocate(fd: int, offset: int, size: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", fallocate)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EIO])
async def test_a_slab_that_cannot_be_allocated_raises_from_reserve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """reserve answered None (as if full) while the store was nearly empty, so the tier
    stayed healthy with 0 pages; now it raises TierIOError naming the slab file, the OS
    error and the free space, keeps no slot, and works again once space returns."""
    async with store(tmp_path / "s") as s:
        four = [key(i) for i in range(4)]
        assert await s.put(four, [page(i) for i in range(4)]) == [True] * 4  # slab 0 full
        refuse_space(monkeypatch, code)
        with capture_logs() as logs:
            with pytest.raises(TierIOError) as info:
                await s.reserve([key(i) for i in range(4, 10)])  # needs slab 1
            assert await s.put([key(9)], [page(9)]) == [False]  # put still answers
        message = str(info.value)
        assert "slab-00001.dat" in message and os.strerror(code) in message
        assert "free" in message and "not full" in message
        assert len(events(logs, "nvme.slab_allocation_failed")) == 1
        assert s.used_pages() == 4  # no slot of the failed calls is kept
        monkeypatch.undo()  # space is back
        more = [key(i) for i in range(20, 26)]
        assert await s.put(more, [page(i) for i in range(20, 26)]) == [True] * 6


async def test_a_store_at_its_capacity_still_answers_none(tmp_path: Path) -> None:
    async with store(tmp_path / "s", capacity=4) as s:
        assert await s.put([key(i) for i in range(4)], [page(i) for i in range(4)]) == [True] * 4
        assert await s.reserve([key(9)]) == [None]


async def test_an_index_transaction_that_fails_raises_from_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit whose index transaction failed (disk full) answered False quietly, the
    tier healthy; now commit raises TierIOError, put still answers False, slots free."""
    async with store(tmp_path / "s") as s:
        full = sqlite_error("database or disk is full", 13)

        def insert(rows: Any) -> None:
            raise full

        monkeypatch.setattr(s._index, "insert", insert)
        res = await s.reserve([key(1), key(2)])
        assert all(r is not None for r in res)
        assert await s.write(res, [page(1), page(2)]) == [True, True]  # type: ignore[arg-type]
        with pytest.raises(TierIOError, match=r"database or disk is full.*free"):
            await s.commit(res)  # type: ignore[arg-type]
        assert s.used_pages() == 0 and await s.contains([key(1), key(2)]) == [False, False]
        assert await s.put([key(3)], [page(3)]) == [False]
        monkeypatch.undo()
        assert await s.put([key(3)], [page(3)]) == [True]


async def test_a_cache_marks_the_tier_failing_once_and_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end: the NVMe tier whose disk fills mid-run is marked failing (one warning,
    ``outage_open`` in its description), its pages stay in DRAM, and once space returns
    they go down and one "tier recovered" line is logged."""
    nvme = tier("nvme", "nvme", 64, options={"path": str(tmp_path / "n"), "slab_bytes": 16384})
    cfg: dict[str, Any] = {"model": {"preset": "tiny"}, "tiers": [tier("dram", "dram", 64), nvme]}
    rng = np.random.default_rng(4)
    async with open_cache(cfg) as cache:
        data = rng.integers(0, 256, (2, TINY_PAGE), dtype=np.uint8)
        first = (await cache.store(np.arange(8), data)).keys
        await cache.flush()
        nv = cache.tiers[1]
        refuse_space(monkeypatch)
        more = rng.integers(0, 256, (12, TINY_PAGE), dtype=np.uint8)
        with capture_logs() as logs:
            keys = (await cache.store(np.arange(100, 148), more)).keys
            await cache.flush()
            out = np.empty_like(data)
            assert await cache.read(first, out) == [True, True]
            await cache.flush()
        failing = events(logs, "tier failing")
        assert len(failing) == 1 and failing[0]["tier"] == "nvme" and failing[0]["op"] == "reserve"
        desc = next(t for t in cache.stats()["tiers"] if t["name"] == "nvme")
        assert desc["outage_open"] and desc["outages"] == 1
        # the pages whose reserve raised are counted as failed (they were not before)
        assert cache.metrics.snapshot()["tiers"]["nvme"]["failed_pages"] >= len(keys)
        assert all(cache.directory.state(k, "nvme") is None for k in keys)  # kept in DRAM
        nv.recovery_quiet_s = 0.0  # (the default 10 s is tested above on a clock)
        monkeypatch.undo()
        with capture_logs() as logs:
            await cache.flush()
        assert len(events(logs, "tier recovered")) == 1 and not nv.in_outage
        assert all(cache.directory.state(k, "nvme") is PageState.COMMITTED for k in keys)
        back = np.empty_like(more)
        assert all(await cache.read(keys, back)) and np.array_equal(back, more)


# -- F8: an empty index beside slabs is damage, for inspect as for open ----------------------


def test_an_empty_index_is_damage_for_inspect_and_rebuild(tmp_path: Path) -> None:
    """A 0-byte index.sqlite: inspect exited 2 "not a kvtier store index: no such table:
    meta" while opening the store rebuilt it; now exit 1 naming it, and --rebuild-index
    reports what was wrong with the old index (not "readable")."""
    import asyncio

    root = tmp_path / "s"
    asyncio.run(make_store(root))
    (root / INDEX_FILE).write_bytes(b"")
    with pytest.raises(DamagedStoreError, match=r"is damaged \(empty: no tables"):
        inspect_store(root)
    result = CliRunner().invoke(get_app(), ["inspect", "store", str(root)])
    assert result.exit_code == 1, result.output
    assert "is damaged (empty: no tables" in result.output
    report = rebuild_index(root)
    assert report["old_index"] == "empty: no tables (a 0-byte or emptied file)"
    assert report["pages"] == 6 and inspect_store(root)["pages"] == 6

    with sqlite3.connect(root / INDEX_FILE) as db:  # emptied: tables but no meta record
        db.execute("DELETE FROM meta")
    assert rebuild_index(root)["old_index"] == "has no format record"
    idx = StoreIndex(root / INDEX_FILE, readonly=True)
    try:
        assert idx.lacking() is None
    finally:
        idx.close()


async def test_opening_a_store_with_an_empty_index_rebuilds_it(tmp_path: Path) -> None:
    root = tmp_path / "s"
    await make_store(root)
    (root / INDEX_FILE).write_bytes(b"")
    await check_pages(root)
