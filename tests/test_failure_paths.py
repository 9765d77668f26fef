"""Failure paths of backends, observed through the cache's public API.

One test per bug of the failure-path audit: a read that fails in one chunk while other
chunks still write, an abort that raises (private slots, a cancelled backend future), a
commit whose reply is lost, an observer whose ``aclose`` fails, a short ``preadv``, and
deletes that do not reach the disk (file store, NVMe index). The failures are injected by
the backends of tests/fault_stores.py. Each test says what went wrong before its fix.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cache_kit import config, open_cache, tier
from fault_stores import (
    AbortFailArena,
    CancelledAbortStore,
    CancelledGetStore,
    ChunkFault,
    CommitThenRaiseStore,
    FsyncFailStore,
    IndexDeleteFailNvme,
    ReserveFailArena,
    ShortReadFileStore,
    ShortReserveArena,
    UnlinkFailStore,
    nvme_group_reads_fail,
)

from kvtier.cache import KVCache
from kvtier.errors import CapacityError, TierIOError
from kvtier.keys import PageKey, PrivateKeys


@pytest.fixture(autouse=True)
def no_fault_left_on() -> Iterator[None]:
    """Every injected failure is off before and after each test."""

    def off() -> None:
        ChunkFault.armed = False
        AbortFailArena.fail_abort = 0
        ShortReserveArena.short_reserve = False
        CancelledGetStore.cancel_gets = False
        CancelledAbortStore.failing = False
        CommitThenRaiseStore.raise_after_commit = False
        ShortReadFileStore.short_reads = 0
        UnlinkFailStore.read_only = False
        IndexDeleteFailNvme.fail_index_delete = False
        ReserveFailArena.fail_reserve = False
        FsyncFailStore.fail_fsync = False

    off()
    yield
    off()


def pages_for(cache: KVCache, rng: np.random.Generator, n: int) -> tuple[Any, np.ndarray]:
    """Random token ids for ``n`` full pages of ``cache``'s spec, and random page bytes."""
    spec = cache.spec
    tokens = rng.integers(0, 50_000, size=n * spec.page_tokens)
    return tokens, rng.integers(0, 256, size=(n, spec.page_bytes), dtype=np.uint8)


async def stored(cache: KVCache, rng: np.random.Generator, n: int) -> tuple[list[PageKey], Any]:
    tokens, data = pages_for(cache, rng, n)
    return (await cache.store(tokens, data)).keys, data


async def not_cancelled(call: Any, what: str, timeout_s: float = 2.0) -> Any:
    """Await ``call``; a CancelledError that reaches this (uncancelled) test, or a call
    still waiting after ``timeout_s``, fails the test with ``what`` named."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except asyncio.CancelledError:
        pytest.fail(f"{what} raised CancelledError to a caller nobody cancelled")
    except TimeoutError:
        pytest.fail(f"{what} still waiting after {timeout_s} s (hang)")


def file_tier_config(tmp: Path, backend: str, **pipeline: Any) -> dict[str, Any]:
    cfg = config(tmp, dram_pages=16, file_pages=64, file_backend=backend, **pipeline)
    cfg["log"]["level"] = "critical"
    return cfg


# -- 1: a chunked read that fails in one chunk -----------------------------------------


def chunked_read_config(tmp: Path, lower: str) -> dict[str, Any]:
    if lower == "file":
        cfg = file_tier_config(tmp, "fault_stores:ChunkFailFileStore")
        cfg["tiers"][1]["options"]["io_threads"] = 2
        return cfg
    # NVMe pages are whole blocks: 32 tokens of the tiny model (128 bytes each)
    return {
        "model": {"preset": "tiny", "page_tokens": 32},
        "log": {"format": "json", "level": "critical"},
        "tiers": [
            {"name": "dram", "backend": "dram", "capacity": 16 * 4096},
            {"name": "nvme", "backend": "nvme", "capacity": 64 * 4096,
             "options": {"path": str(tmp / "nvme"), "io_threads": 2, "engine": "posix",
                         "preallocate": False}},
        ],
    }  # fmt: skip


@pytest.mark.parametrize("lower", ["file", "nvme"])
async def test_a_read_failing_in_one_chunk_returns_once_every_chunk_stopped(
    tmp_path: Path, lower: str
) -> None:
    """A store read cut into chunks raised as soon as one chunk failed, while the other
    chunks' threads still wrote into the load's DRAM slots; the next store reused those
    slots and the late threads overwrote its pages: read() served another page's bytes."""
    if lower == "file" and (os.cpu_count() or 1) < 2:
        pytest.skip("the file store reads in one chunk on a single core")
    rng = np.random.default_rng(1)
    delay_s = 0.2
    with nvme_group_reads_fail():
        async with open_cache(chunked_read_config(tmp_path, lower)) as cache:
            ka, _ = await stored(cache, rng, 4)
            await cache.flush()
            assert await cache.demote("dram", ka) == []  # A is now only below DRAM
            ChunkFault.arm(delay_s)
            start = time.monotonic()
            res = await cache.load(ka, pin=False)
            took = time.monotonic() - start
            ChunkFault.armed = False
            assert len(res.missing) == len(ka)  # the failed read is a miss
            kb, data_b = await stored(cache, rng, 4)  # takes the slots the load gave back
            await asyncio.sleep(delay_s + 0.2)  # a chunk still running has written by now
            assert ChunkFault.chunks >= 2, "the read was not cut into chunks: no point"
            out = np.zeros_like(data_b)
            assert await cache.read(kb, out) == [True] * 4
            wrong = [i for i in range(4) if not np.array_equal(out[i], data_b[i])]
            assert wrong == [], f"pages {wrong} of B hold bytes a failed load wrote late"
            assert took >= delay_s * 0.9, f"the failed load returned after {took:.3f} s"


# -- 2: private slots whose abort raises -------------------------------------------------


def private_config(tmp: Path, arena: str) -> dict[str, Any]:
    cfg = config(tmp, dram_pages=8, file_pages=64)
    cfg["tiers"][0] = tier("dram", f"fault_stores:{arena}", 8)
    cfg["log"]["level"] = "critical"
    return cfg


async def test_a_release_private_whose_abort_failed_can_be_retried(tmp_path: Path) -> None:
    """release_private forgot the slots before the backend's abort, so when that abort
    raised, a retry was refused ('not a private slot') and the slots stayed RESERVED in
    the directory and taken in the backend for good."""
    async with open_cache(private_config(tmp_path, "AbortFailArena")) as cache:
        keys = PrivateKeys(b"failpath-a").take(4)
        slots = await cache.reserve_private(keys)
        AbortFailArena.fail_abort = 1
        with pytest.raises(RuntimeError, match="injected: abort failed"):
            await cache.release_private(slots)
        await cache.release_private(slots)  # the retry gives everything back
        d = cache.directory
        assert [d.state(k, "dram") for k in keys] == [None] * 4
        assert d.reserved("dram") == 0
        assert cache.tiers[0].backend.used_pages() == 0
        d.check_invariants()


async def test_a_short_reserve_private_whose_abort_failed_leaves_no_key_reserved(
    tmp_path: Path,
) -> None:
    """reserve_private, given fewer slots than asked, aborted them outside any try: when
    that abort raised, its error replaced the CapacityError and every key stayed RESERVED
    in the directory, so the same keys could never be reserved again."""
    async with open_cache(private_config(tmp_path, "ShortReserveArena")) as cache:
        keys = PrivateKeys(b"failpath-b").take(3)
        ShortReserveArena.short_reserve = True
        ShortReserveArena.fail_abort = 1
        with pytest.raises(CapacityError, match="only 2 of 3 private slots"):
            await cache.reserve_private(keys)
        ShortReserveArena.short_reserve = False
        d = cache.directory
        assert [d.state(k, "dram") for k in keys] == [None] * 3
        assert d.reserved("dram") == 0
        d.check_invariants()
        slots = await cache.reserve_private(keys)  # the keys are free again
        assert len(slots) == 3
        await cache.release_private(slots)


async def test_a_reserve_private_the_backend_fails_names_the_tier(tmp_path: Path) -> None:
    """The backend's own exception reached the caller as it was, with the tier not marked
    failing; now it is a TierIOError naming the tier, and the keys are free again."""
    async with open_cache(private_config(tmp_path, "ReserveFailArena")) as cache:
        keys = PrivateKeys(b"failpath-r").take(2)
        ReserveFailArena.fail_reserve = True
        with pytest.raises(TierIOError, match="tier 'dram': reserving 2 private slots failed"):
            await cache.reserve_private(keys)
        assert not cache.tiers[0].healthy
        ReserveFailArena.fail_reserve = False
        FsyncFailStore.fail_fsync = False
        assert cache.directory.reserved("dram") == 0
        slots = await cache.reserve_private(keys)
        await cache.release_private(slots)
        cache.directory.check_invariants()


# -- 3: a backend call that raises CancelledError (the caller was not cancelled) ------


async def test_a_backend_get_raising_cancelled_is_a_miss(tmp_path: Path) -> None:
    """A CancelledError from a backend's own future (its executor shut down under it)
    escaped load() and read() to a caller nobody had cancelled, instead of a miss and a
    tier marked failing, as any other exception from the same call is."""
    rng = np.random.default_rng(3)
    async with open_cache(file_tier_config(tmp_path, "fault_stores:CancelledGetStore")) as cache:
        keys, data = await stored(cache, rng, 4)
        await cache.flush()
        assert await cache.demote("dram", keys) == []
        CancelledGetStore.cancel_gets = True
        res = await not_cancelled(cache.load(keys, pin=False), "load()")
        assert list(res.missing) == list(keys)
        out = np.zeros_like(data)
        assert await not_cancelled(cache.read(keys, out), "read()") == [False] * 4
        assert not cache.tiers[1].healthy
        CancelledGetStore.cancel_gets = False
        assert [cache.directory.locate(k) for k in keys] == ["file"] * 4  # nothing lost


async def test_a_backend_abort_raising_cancelled_leaves_no_operation_open(
    tmp_path: Path,
) -> None:
    """A CancelledError from a backend's abort (after a failed write) cut the write-down's
    clean-up short: flush() raised CancelledError, the pages stayed RESERVED with their
    copy operation open, and the next flush (and close) waited for it for ever."""
    rng = np.random.default_rng(4)
    cfg = file_tier_config(tmp_path, "fault_stores:CancelledAbortStore", write_policy="write-back")
    cache = await KVCache.open(cfg, env={})
    try:
        keys, _ = await stored(cache, rng, 2)
        CancelledAbortStore.failing = True
        assert await not_cancelled(cache.flush(), "a flush whose abort failed") == 0
        CancelledAbortStore.failing = False
        assert [cache.directory.state(k, "file") for k in keys] == [None, None]
        assert cache.tiers[1].reserving == 0
        assert await not_cancelled(cache.flush(), "the next flush") == 2
        assert all(cache.directory.is_committed(k, "file") for k in keys)
        await not_cancelled(cache.close(), "close()")
    finally:
        if cache.is_open:  # the test failed: do not hang in close
            await asyncio.wait([asyncio.ensure_future(cache.close())], timeout=2.0)


# -- 4: a commit whose reply is lost --------------------------------------------------


async def test_pages_committed_by_a_commit_that_raised_stay_known(tmp_path: Path) -> None:
    """A commit that raised after committing (its reply lost) was taken as failed and
    aborted (a no-op for committed pages): the backend held and counted pages the
    directory did not know, delete() never reached them, the tier's room leaked, and the
    deleted pages came back at the next open."""
    rng = np.random.default_rng(5)
    cfg = config(tmp_path, dram_pages=16, file_pages=8,
                 file_backend="fault_stores:CommitThenRaiseStore")  # fmt: skip
    cfg["log"]["level"] = "critical"
    async with open_cache(cfg) as cache:
        CommitThenRaiseStore.raise_after_commit = True
        keys, _ = await stored(cache, rng, 6)
        await cache.pipeline.drain()  # the write-through: its commit raises
        CommitThenRaiseStore.raise_after_commit = False
        file = cache.tiers[1]
        assert cache.directory.used("file") == file.backend.used_pages() == 6
        assert await cache.delete(keys) == 12  # DRAM and file copies
        assert file.backend.used_pages() == 0
        cache.directory.check_invariants()
    async with open_cache(cfg) as cache:
        assert [cache.directory.locate(k) for k in keys] == [None] * 6


async def test_pages_whose_directory_fsync_failed_are_not_committed(tmp_path: Path) -> None:
    """The file store's commit raised when a directory fsync failed, after the pages had
    been renamed into place: the cache took them as not committed while their files
    stayed on disk, using space it did not count, until the next open brought them back."""
    rng = np.random.default_rng(10)
    cfg = file_tier_config(tmp_path, "fault_stores:FsyncFailStore")
    cfg["tiers"][1]["options"]["fsync"] = True
    async with open_cache(cfg) as cache:
        FsyncFailStore.fail_fsync = True
        keys, _ = await stored(cache, rng, 4)
        await cache.flush()
        FsyncFailStore.fail_fsync = False
        assert await cache.tiers[1].backend.contains(keys) == [False] * 4
        assert [cache.directory.locate(k) for k in keys] == ["dram"] * 4
        assert cache.tiers[1].backend.used_pages() == 0
        cache.directory.check_invariants()
        files = [p for p in (tmp_path / "file").rglob("*") if p.is_file() and len(p.name) > 30]
        assert files == []  # no page file the store does not count


# -- 5: an observer whose aclose fails -------------------------------------------------


class ClosingObserver:
    """An observer whose ``aclose`` raises (``mode='raise'``) or waits long enough for
    the close to be cancelled meanwhile (``mode='slow'``)."""

    name = "closing-observer"

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def on_lookup(self, keys: Any, found_tiers: Any) -> None:
        pass

    def on_hint(self, hint: Any, now_s: float) -> None:
        pass

    def on_time(self, now_s: float) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}

    async def aclose(self) -> None:
        if self.mode == "raise":
            raise RuntimeError("injected: observer aclose failed")
        await asyncio.sleep(10)


@pytest.mark.parametrize("mode", ["raise", "slow"])
async def test_a_failing_observer_aclose_still_closes_the_cache(tmp_path: Path, mode: str) -> None:
    """close() awaited the observers' aclose before its try/finally: one that raised (or
    a close cancelled while it waited) left the cache 'closing' for ever, with no flush,
    no backend closed (the store stayed locked) and every later close() hanging."""
    rng = np.random.default_rng(6)
    cfg = file_tier_config(tmp_path, "file", write_policy="write-back")
    cache = await KVCache.open(cfg, env={})
    cache.attach(ClosingObserver(mode))
    keys, _ = await stored(cache, rng, 4)
    if mode == "raise":
        await cache.close()  # the observer's failure is logged, not raised
    else:
        closing = asyncio.create_task(cache.close())
        await asyncio.sleep(0.1)  # in the observer's aclose
        closing.cancel()  # as a shutdown timeout does
        with pytest.raises(asyncio.CancelledError):
            await closing
    assert not cache.is_open
    await not_cancelled(cache.close(), "a second close()")
    async with open_cache(cfg) as again:  # the file store was closed: its lock is free
        assert again.skipped_tiers == {}
        if mode == "raise":  # the close flushed the dirty pages
            assert [again.directory.locate(k) for k in keys] == ["file"] * 4


# -- 6: a short preadv ------------------------------------------------------------------


async def test_a_short_read_is_read_on_not_taken_for_a_damaged_page(tmp_path: Path) -> None:
    """The file store took a short preadv (allowed by POSIX: FUSE, network file systems,
    a signal) for a damaged page: the read was a miss, counted as a checksum failure, and
    the intact committed page file was deleted."""
    rng = np.random.default_rng(7)
    cfg = file_tier_config(tmp_path, "fault_stores:ShortReadFileStore")
    async with open_cache(cfg) as cache:
        keys, data = await stored(cache, rng, 1)
        await cache.flush()
        assert await cache.demote("dram", keys) == []
        ShortReadFileStore.short_reads = 1
        out = np.zeros_like(data)
        ok = await cache.read(keys, out)
        assert ShortReadFileStore.short_reads == 0, "no short read happened: no point"
        assert ok == [True]
        assert np.array_equal(out, data)
        assert cache.tiers[1].backend.stats()["checksum_failures"] == 0
        assert cache.directory.locate(keys[0]) == "file"


# -- 7, 8: deletes that do not reach the disk -----------------------------------------


async def test_a_file_delete_the_file_system_refuses_keeps_the_pages(tmp_path: Path) -> None:
    """The file store dropped a page from its index and answered True whatever its file
    removal did: on a file system refusing the unlink (read-only after an error), delete()
    counted the pages removed and the cache forgot them, but their files stayed and the
    deleted pages came back at the next open."""
    rng = np.random.default_rng(8)
    cfg = file_tier_config(tmp_path, "fault_stores:UnlinkFailStore")
    async with open_cache(cfg) as cache:
        keys, _ = await stored(cache, rng, 4)
        await cache.flush()
        UnlinkFailStore.read_only = True
        assert await cache.delete(keys) == 4  # the DRAM copies only
        UnlinkFailStore.read_only = False
        assert [cache.directory.locate(k) for k in keys] == ["file"] * 4
        assert await cache.tiers[1].backend.contains(keys) == [True] * 4
        cache.directory.check_invariants()
        assert await cache.delete(keys) == 4  # once the file system allows it
    async with open_cache(cfg) as cache:
        assert [cache.directory.locate(k) for k in keys] == [None] * 4


async def test_an_nvme_delete_the_index_refuses_keeps_the_pages(tmp_path: Path) -> None:
    """The NVMe store answered True for pages whose index rows it could not delete: the
    cache forgot pages the store still counted (the tier's room shrank with nothing to
    evict) and the deleted pages came back at the next open."""
    rng = np.random.default_rng(9)
    cfg = {
        "model": {"preset": "tiny"},
        "log": {"format": "json", "level": "critical"},
        "tiers": [
            tier("dram", "dram", 16),
            tier("nvme", "fault_stores:IndexDeleteFailNvme", 8,
                 options={"path": str(tmp_path / "nvme"), "preallocate": False}),
        ],
    }  # fmt: skip
    async with open_cache(cfg) as cache:
        keys, _ = await stored(cache, rng, 6)
        await cache.flush()
        nvme = cache.tiers[1].backend
        IndexDeleteFailNvme.fail_index_delete = True
        assert await cache.delete(keys) == 6  # the DRAM copies only
        IndexDeleteFailNvme.fail_index_delete = False
        ReserveFailArena.fail_reserve = False
        FsyncFailStore.fail_fsync = False
        assert [cache.directory.locate(k) for k in keys] == ["nvme"] * 6
        assert cache.directory.used("nvme") == nvme.used_pages() == 6
        cache.directory.check_invariants()
        assert await cache.delete(keys) == 6  # once the index allows it
        assert nvme.used_pages() == 0
    async with open_cache(cfg) as cache:
        assert [cache.directory.locate(k) for k in keys] == [None] * 6
